"""The checkpoint manager: the context object that gathers the notice sources, the policy,
the measurements and the object store behind the SDK calls.

What it measures, and how:
- `T_step`: each `step()` block's duration; the policy uses the longest of the last 16
  (the step in flight when a notice lands must finish, so be pessimistic).
- `δ` (save time): from the end of the last step to the `backup()` call — the script saves
  in between. Until one is measured, `RHIZOME_SAVE_S`.
- `β` (backup time): how long the store took to commit. Until one is measured,
  `RHIZOME_BACKUP_S`.
- MTTP and R come from the platform (`RHIZOME_MTTP_S`, `RHIZOME_RESTART_S`).

Emergency timing: after a notice the script trains on while one more step plus twice
(step + save + backup) still fit in the time left, then `should_save()` says "emergency" —
the checkpoint then holds every step done before the preemption.

Save kinds: a `backup()` that follows a `should_save()` that said "emergency" or
"insurance" is of that kind. A `backup()` after a notice from a script that has not asked
`should_save()` since the notice came is the emergency one too: such a script saves on its
own schedule (every epoch, say) and would otherwise train on through the grace and be
killed at its end with its last save behind it (a halt of the MNIST example did exactly
that). Any other `backup()` is the script's own periodic save, which resets the insurance
clock like any save. Periodic and insurance backups run on one
background thread (so they commit in order); an emergency backup runs in the caller,
after the queued ones, then the notice is acknowledged and — unless
`RHIZOME_EMERGENCY_EXIT=0` — the process exits at once (`os._exit`) with status 143.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from contract.checkpoints import CheckpointReport
from contract.env import LearnerEnv
from contract.status import ExitCode
from learner.checkpoint import notices, policy
from learner.checkpoint.api import (
    CheckpointKind,
    CommittedCheckpoint,
    ObjectStore,
    PreemptionNotice,
    PreemptionNoticeSource,
)
from learner.checkpoint.storage import GarbageCollectingStore, LocalDirectoryStore, open_store

log = logging.getLogger("rhizome.checkpoint")


def _size_bytes(path: Path) -> int:
    """A checkpoint's size on disk: the file, or every file under the directory."""
    try:
        if path.is_dir():
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        return path.stat().st_size
    except OSError:
        return 0


class CheckpointManager:
    """The real context behind `learner.sdk` (see `DummyContext` for the bare twin)."""

    enabled = True

    def __init__(
        self,
        env: LearnerEnv,
        *,
        store: ObjectStore | None = None,
        sources: list[PreemptionNoticeSource] | None = None,
    ) -> None:
        self.env = env
        self.root = env.checkpoint_root / env.checkpoint_job / env.learner_id
        # The learner's own directory (events, restored checkpoints) exists whatever the
        # store is; a remote store does not create it.
        self.root.mkdir(parents=True, exist_ok=True)
        self.store = store or self._open_store(env)
        self.staging = env.checkpoint_root / ".staging" / env.checkpoint_job / env.learner_id
        self.board = (
            notices.NoticeBoard(sources)
            if sources is not None
            else notices.NoticeBoard.from_env(env)
        )
        self.sources = self.board.sources
        self._step_times: deque[float] = deque(maxlen=16)
        self._save_s = env.save_s
        self._backup_s = env.backup_s
        self._save_measured = False
        self._backup_measured = False
        self._in_step = False
        self._last_step_end: float | None = None
        self._pending_reason: str | None = None
        self._emergency_done = False
        self._asked_since_notice = False  # should_save() called with a notice pending
        self._periodic_points: deque[float] = deque(maxlen=2)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rhizome-backup")
        self._futures: list[Future[CommittedCheckpoint]] = []
        self._lock = threading.Lock()
        self.last_decision: policy.Decision | None = None
        latest = self.store.latest()
        self.steps_done = latest.step if latest else 0
        self._last_save_point = time.monotonic()
        self.board.start()

    # -- notices -------------------------------------------------------------------
    def _on_notice(self, notice: PreemptionNotice) -> None:
        # Runs in a signal handler or a polling thread: only record, decide at the next
        # step boundary.
        self.board.on_notice(notice)

    @property
    def _notice(self) -> PreemptionNotice | None:
        return self.board.notice

    @property
    def notice(self) -> PreemptionNotice | None:
        return self._notice

    def preempted(self) -> bool:
        return self._notice is not None

    # -- measurements -------------------------------------------------------------
    @property
    def step_s(self) -> float:
        return max(self._step_times) if self._step_times else 0.0

    @property
    def save_s(self) -> float:
        return self._save_s

    @property
    def backup_s(self) -> float:
        return self._backup_s

    @property
    def expected_grace_s(self) -> float:
        return notices.expected_grace_s(self.sources, self.env.grace_s)

    def interval_s(self) -> float:
        """The insurance interval: the manifest's under the fixed policy, else Daly's
        optimum from the platform's preemption estimates."""
        if self.env.checkpoint_policy == "fixed" and self.env.checkpoint_interval_s:
            return self.env.checkpoint_interval_s
        return policy.daly_interval(self._save_s, self.env.mttp_s, self.env.restart_s)

    # -- SDK calls ------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        start = time.monotonic()
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False
        end = time.monotonic()
        self._step_times.append(end - start)
        self._last_step_end = end
        self.steps_done += 1

    def _next_periodic_in(self, now: float) -> float | None:
        if not self._periodic_points:
            return None
        period = self.env.periodic_every_s
        if period is None and self.env.checkpoint_policy == "adaptive":
            # Under the adaptive policy the manifest's interval is the script's own period.
            period = self.env.checkpoint_interval_s
        if period is None and len(self._periodic_points) == 2:
            period = self._periodic_points[1] - self._periodic_points[0]
        if period is None:
            return None
        return self._periodic_points[-1] + period - now

    def should_save(self) -> bool:
        now = time.monotonic()
        if self.env.checkpoint_policy == "none":
            # The manifest said the script saves when it wants: no emergency or insurance
            # saves from the platform.
            self.last_decision = policy.Decision(False, "policy-none", self.interval_s())
            return False
        notice = self._notice
        if notice is not None and not self._emergency_done:
            self._asked_since_notice = True
            left = notice.time_left(time.time())
            # Train on while the next step and twice (step + save + backup) still fit —
            # a safety factor of 2 on estimates that may be priors: the emergency
            # checkpoint then holds as much work as it safely can.
            margin = self.step_s + 2 * (self.step_s + self._save_s + self._backup_s)
            if margin < left:
                self.last_decision = policy.Decision(False, "emergency-deferred", self.interval_s())
                return False
            # The step has finished by now, so only the save and the backup must fit.
            if policy.emergency_save_fits(0.0, self._save_s, self._backup_s, left):
                self._pending_reason = "emergency"
                self.last_decision = policy.Decision(True, "emergency", self.interval_s())
                return True
            if self._pending_reason != "emergency-missed":
                log.warning(
                    "preemption notice from %s leaves %.2fs, too little for a save (%.2fs) "
                    "and backup (%.2fs): resume will use the last committed checkpoint",
                    notice.source,
                    left,
                    self._save_s,
                    self._backup_s,
                )
                self._pending_reason = "emergency-missed"
        decision = policy.insurance_decision(
            since_last_save_s=now - self._last_save_point,
            step_s=self.step_s,
            save_s=self._save_s,
            backup_s=self._backup_s,
            mttp_s=self.env.mttp_s,
            restart_s=self.env.restart_s,
            grace_s=self.expected_grace_s,
            # Fixed: insurance saves every interval, whether or not a notice would come.
            mode="always" if self.env.checkpoint_policy == "fixed" else self.env.insurance,
            next_periodic_in_s=self._next_periodic_in(now),
            interval_s=self.interval_s(),
        )
        self.last_decision = decision
        if decision.save:
            self._pending_reason = "insurance"
        return decision.save

    def staging_path(self, name: str) -> Path:
        """A fresh local path to save into; `backup()` removes it once committed."""
        path = self.staging / f"{uuid.uuid4().hex[:8]}-{name}"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def backup(self, path: str | Path, *, step: int | None = None) -> Future[CommittedCheckpoint]:
        now = time.monotonic()
        source = Path(path)
        reason = self._pending_reason if self._pending_reason != "emergency-missed" else None
        self._pending_reason = None
        if (
            reason is None
            and self._notice is not None
            and not self._emergency_done
            and not self._asked_since_notice
            and self.env.checkpoint_policy != "none"
        ):
            reason = "emergency"  # a script that never asks: its save after the notice
        kind = {
            "emergency": CheckpointKind.EMERGENCY,
            "insurance": CheckpointKind.INSURANCE,
        }.get(reason or "", CheckpointKind.PERIODIC)
        if self._last_step_end is not None and not self._in_step:
            self._save_s = now - self._last_step_end
            self._save_measured = True
        point = self._last_step_end if self._last_step_end is not None else now
        self._last_save_point = point
        if kind is CheckpointKind.PERIODIC:
            self._periodic_points.append(point)
        at_step = self.steps_done if step is None else step
        meta: dict[str, Any] = {
            "reason": kind.value,
            "step_s": self.step_s,
            "save_s": self._save_s,
            "backup_s": self._backup_s,
            "interval_s": self.interval_s(),
            "mttp_s": self.env.mttp_s,
            "restart_s": self.env.restart_s,
            "job_id": self.env.checkpoint_job,
            "learner_id": self.env.learner_id,
        }
        if self._notice is not None:
            meta["notice"] = {"source": self._notice.source, "deadline": self._notice.deadline}
        future = self._executor.submit(self._commit, source, at_step, kind, meta)
        self._futures = [f for f in self._futures if not f.done()] + [future]
        if kind is CheckpointKind.EMERGENCY:
            committed = future.result()
            self._emergency_done = True
            self._acknowledge(committed)
        return future

    def _commit(
        self, source: Path, step: int, kind: CheckpointKind, meta: dict[str, Any]
    ) -> CommittedCheckpoint:
        size = _size_bytes(source)  # before: a staged source is removed after the commit
        start = time.monotonic()
        committed = self.store.commit(source, step=step, kind=kind, metadata=meta)
        with self._lock:
            self._backup_s = time.monotonic() - start
            self._backup_measured = True
        if isinstance(self.store, GarbageCollectingStore):
            self.store.collect_garbage()
        with contextlib.suppress(ValueError):
            if source.resolve().is_relative_to(self.staging.resolve()):
                if source.is_dir():
                    shutil.rmtree(source, ignore_errors=True)
                else:
                    source.unlink(missing_ok=True)
        self._record({"event": "committed", "kind": kind.value, "step": step, **meta})
        self._report(committed, size)
        return committed

    def _report(self, committed: CommittedCheckpoint, size: int) -> None:
        """Tell the platform (contract/checkpoints.py: a line on stderr, which every backend
        ships to the TDS); flushed at once, as an emergency save exits right after."""
        report = CheckpointReport(
            kind=committed.kind.value,
            step=committed.step,
            size_bytes=size,
            time=committed.committed_at,
            learner=str(self.env.learner_id),
            name=committed.name,
        )
        print(report.line(), file=sys.stderr, flush=True)

    def _record(self, event: dict[str, Any]) -> None:
        event["time"] = time.time()
        with self._lock, open(self.root / "events.jsonl", "a") as fh:
            fh.write(json.dumps(event, sort_keys=True) + "\n")

    def _acknowledge(self, committed: CommittedCheckpoint) -> None:
        notice = self._notice
        self.board.acknowledge()
        self._record({"event": "acknowledged", "step": committed.step, "name": committed.name})
        log.warning(
            "emergency checkpoint %s committed at step %d after a %s notice",
            committed.name,
            committed.step,
            notice.source if notice else "?",
        )
        if self.env.emergency_exit:
            self.close(wait=False)
            sys.stdout.flush()
            sys.stderr.flush()
            # Leave now: the checkpoint is committed and the node is about to go; a normal
            # interpreter shutdown (torch teardown, atexit) can outlast the grace period.
            os._exit(ExitCode.PREEMPTED)

    def _open_store(self, env: LearnerEnv) -> ObjectStore:
        """The checkpoint dir, or RHIZOME_BACKUP_URL (e.g. s3://bucket/prefix) namespaced
        by job and learner as the local store is."""
        if not env.backup_url:
            return LocalDirectoryStore(self.root, keep_periodic=env.keep)
        url = f"{env.backup_url.rstrip('/')}/{env.checkpoint_job}/{env.learner_id}"
        return open_store(url, keep_periodic=env.keep)

    def latest_checkpoint(self) -> CommittedCheckpoint | None:
        """The newest committed checkpoint, as local files: one in a remote store is
        downloaded into the learner's checkpoint directory first."""
        latest = self.store.latest()
        fetch = getattr(self.store, "fetch", None)
        if latest is None or fetch is None:
            return latest
        local = Path(fetch(latest, self.root / "restored" / latest.name))
        return dataclasses.replace(latest, path=local)

    def wait_backups(self) -> list[CommittedCheckpoint]:
        """Block until every queued backup is committed; re-raises a failed one."""
        done = [f.result() for f in list(self._futures)]
        self._futures = []
        return done

    def close(self, wait: bool = True) -> None:
        if wait:
            self.wait_backups()
        self.board.stop()
        self._executor.shutdown(wait=wait)


class DummyContext:
    """The bare twin: same calls, no platform. `step()` just runs the block, `should_save()`
    is always False, `backup()` does nothing, `latest_checkpoint()` is None."""

    enabled = False
    steps_done = 0
    notice = None
    last_decision = None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        yield
        self.steps_done += 1

    def should_save(self) -> bool:
        return False

    def preempted(self) -> bool:
        return False

    def staging_path(self, name: str) -> Path:
        return Path(name)

    def backup(self, path: str | Path, *, step: int | None = None) -> Future[CommittedCheckpoint]:
        future: Future[CommittedCheckpoint] = Future()
        future.cancel()
        return future

    def latest_checkpoint(self) -> CommittedCheckpoint | None:
        return None

    def wait_backups(self) -> list[CommittedCheckpoint]:
        return []

    def close(self, wait: bool = True) -> None:
        return None
