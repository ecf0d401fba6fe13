"""The few calls a training script makes (ARCHITECTURE §6)::

    import learner.sdk as rz

    ckpt = rz.latest_checkpoint()           # None on a fresh start (and always when bare)
    start = load(ckpt.path) if ckpt else 0
    for i in range(start, steps):
        with rz.step():
            train_step(i)
        if i % save_every == 0 or rz.should_save():
            path = rz.staging_path("model.pt")
            save(path)
            rz.backup(path)                   # background; an emergency one exits after

On the platform (`RHIZOME_JOB_ID` or `RHIZOME_CHECKPOINT_DIR` set) the calls go to a
`CheckpointManager`; anywhere else to its dummy twin, so the same script runs bare.
The context is created on first use, from the main thread (it installs the SIGTERM
handler); `init()` creates it explicitly, e.g. with a non-default environment.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path

from contract.env import LearnerConfigError, LearnerEnv
from contract.status import ExitCode
from learner.checkpoint.api import CommittedCheckpoint
from learner.checkpoint.manager import CheckpointManager, DummyContext

Context = CheckpointManager | DummyContext
_context: Context | None = None


def init(env: Mapping[str, str] | None = None) -> Context:
    """Create (or replace) the process-wide context from `env` (default `os.environ`).

    With the process's own environment, a missing or malformed variable ends the process
    like every learner entry point: one line naming it, exit `ExitCode.CONFIG_ERROR`
    (a script cannot repair its environment). With an explicit `env` it raises
    `LearnerConfigError`."""
    global _context
    if _context is not None:
        _context.close()
    try:
        parsed = LearnerEnv.from_environ(os.environ if env is None else env)
    except LearnerConfigError as exc:
        if env is not None:
            raise
        print(f"rhizome: {exc}", file=sys.stderr, flush=True)
        sys.exit(ExitCode.CONFIG_ERROR)
    _context = CheckpointManager(parsed) if parsed.enabled else DummyContext()
    return _context


def context() -> Context:
    """The current context, created from the environment on first use."""
    return _context if _context is not None else init()


@contextlib.contextmanager
def step() -> Iterator[None]:
    """Mark one training step; its duration feeds the checkpoint policy."""
    with context().step():
        yield


def should_save() -> bool:
    """True when the script should save and `backup()` now (emergency or insurance)."""
    return context().should_save()


def preempted() -> bool:
    """True once a preemption notice has arrived."""
    return context().preempted()


def staging_path(name: str) -> Path:
    """A fresh path to save a checkpoint into before `backup()` (removed once committed)."""
    return context().staging_path(name)


def backup(path: str | Path, *, step: int | None = None) -> Future[CommittedCheckpoint]:
    """Back up what the script just saved at `path` (file or directory).

    `step` defaults to the number of completed `step()` blocks (continuing from the
    checkpoint resumed from). Do not write to `path` again until the returned future is
    done; `staging_path()` gives a new path each time.
    """
    return context().backup(path, step=step)


def latest_checkpoint() -> CommittedCheckpoint | None:
    """The newest committed checkpoint of this job and learner, or None."""
    return context().latest_checkpoint()


def wait_backups() -> list[CommittedCheckpoint]:
    """Wait for every background backup to commit (call before a normal exit)."""
    return context().wait_backups()


def close() -> None:
    """Wait for backups, stop watching for notices, forget the context."""
    global _context
    if _context is not None:
        _context.close()
        _context = None
