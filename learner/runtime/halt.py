"""A preemption notice in a pipeline worker: the emergency block save of a halt, or a
graceful leave of one worker.

The notices come from the checkpoint layer's own sources (learner/checkpoint/notices.py,
`NoticeBoard`: `sigterm` and the clouds' metadata notices, `RHIZOME_NOTICE_SOURCES`);
whether a save fits is the checkpoint policy's rule (learner/checkpoint/policy.py,
`emergency_save_fits`). What this module adds is the agreement between the workers.

Keys, under the job's runtime prefix (docs/architecture.md):

- ``halt/notice/<w>`` ``{"generation", "step", "deadline", "source"}``: worker w got a
  notice while in (or about to start) ``step``. Put by its watcher thread as soon as it
  wakes after the notice (the step loop puts it too, at its boundary, if first), so it
  does not wait for the worker's progress.
- ``halt/decision/<g>`` ``{"step": s}``: the step boundary every worker saves at, created
  once (first writer wins) by a worker that sees every live worker of generation g
  noticed: ``s = max(noticed steps) + 1``. A worker stops at its first step boundary
  after its notice until the decision exists, so none is past ``s`` when it reads it, and
  the decision needs only the notices (put independently of the steps), so no worker
  waits for a peer that waits for it.
- ``halt/saved/<g>/<w>``: worker w saved at ``s`` (or could not); every worker leaves
  once each live one has (or at its notice's deadline), so none exits while a peer still
  needs its messages of the steps before ``s``.
- a notice that not every live worker got within ``NOTICE_WINDOW_S`` (one node
  preempted, a spot notice) is one worker's: it does not save alone; it declares itself
  dead at its step boundary (``failures/<w>-<w>``, ``state`` by compare-and-set), so its
  peers fail over at once instead of after the detection timeout, and exits.

Either way the worker leaves with ``Preempted`` (exit ``ExitCode.PREEMPTED``).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from contract.checkpoints import CheckpointReport
from learner.checkpoint.notices import NoticeBoard
from learner.checkpoint.policy import emergency_save_fits
from learner.runtime import block_checkpoint
from learner.runtime.api import Interrupted, Preempted
from learner.runtime.cluster_state import ClusterStateStore
from learner.runtime.worker_state import WorkerState

# How long a worker with a notice waits at its step boundary for every live worker's
# notice before it takes the notice for its own alone (at most a quarter of the time
# left). A halt's SIGTERMs reach every worker within milliseconds; each watcher puts its
# key within a third of the lease TTL (engine.KEEPALIVES_PER_TTL).
NOTICE_WINDOW_S = 5.0
POLL_S = 0.02


class Halt:
    """One worker's side of the agreement (the module docstring)."""

    def __init__(
        self,
        state: WorkerState,
        cluster: ClusterStateStore,
        board: NoticeBoard,
        *,
        checkpoint_dir: str | None,
        save_prior_s: float,
        declare_dead: Callable[[int, str], None],
    ) -> None:
        self.state = state
        self.cluster = cluster
        self.board = board
        self.checkpoint_dir = checkpoint_dir
        # seconds a block save takes: the last one measured (a periodic save), else the
        # checkpoint layer's prior (`RHIZOME_SAVE_S`)
        self.save_s = save_prior_s
        self.step_s = 0.0  # the longest recent step, set by the engine
        self._declare_dead = declare_dead
        self._lock = threading.Lock()
        self._posted: int | None = None  # the generation this worker's notice was put for
        self.target: int | None = None  # the decided step boundary
        # once the decision is known, peers that leave are not failures (engine's watcher)
        self.halting = False

    # ------------------------------------------------------------------ notices

    def post(self) -> None:
        """Put this worker's notice key if it has a notice (watcher thread and step loop)."""
        notice = self.board.notice
        st = self.state
        if notice is None:
            return
        with self._lock:
            if self._posted == st.generation:
                return
            self.cluster.put(
                f"halt/notice/{st.me}",
                {
                    "generation": st.generation,
                    "step": st.step,
                    "deadline": notice.deadline,
                    "source": notice.source,
                },
            )
            self._posted = st.generation

    def _noticed(self, generation: int) -> dict[int, int]:
        """Live worker -> the step its notice was put at, for generation ``generation``."""
        got = self.cluster.get_prefix("halt/notice/")
        return {
            int(k.rsplit("/", 1)[1]): int(v["step"])
            for k, v in got.items()
            if int(v.get("generation", -1)) == generation
        }

    # ------------------------------------------------------------- step boundary

    def at_boundary(self, step: int, last_periodic: int | None) -> None:
        """Called by the step loop before ``step``; returns to train on, raises
        ``Preempted`` to leave, ``Interrupted`` when the generation moved meanwhile."""
        notice = self.board.notice
        if notice is None:
            return
        st = self.state
        target = self.target
        if target is None:
            self.post()
            target = self._agree(step, notice.deadline)
            if target is None:
                self._leave_alone(step)
            self.target = target
            self.halting = True
            left = notice.deadline - time.time()
            steps_left = max(0, target - step)
            if not emergency_save_fits(steps_left * self.step_s, self.save_s, 0.0, left):
                where = (
                    f"the last periodic checkpoint (step {last_periodic})"
                    if last_periodic is not None
                    else "the start (no checkpoint)"
                )
                st.log(
                    f"emergency block save at step {target} does not fit in the "
                    f"{left:.1f} s left ({steps_left} step(s) of {self.step_s:.2f} s + a save "
                    f"of {self.save_s:.2f} s): leaving; the resume uses {where}"
                )
                raise Preempted(f"worker {st.me} left on a {notice.source} notice without a save")
            st.log(f"{notice.source} notice: every worker saves at step {target}")
        if step < target:
            return  # train on to the agreed boundary
        self._save_and_leave(step, notice.deadline, notice.source)

    def _agree(self, step: int, deadline: float) -> int | None:
        """The decided step boundary, or None when not every live worker got a notice."""
        st = self.state
        g = st.generation
        window_end = time.time() + min(NOTICE_WINDOW_S, max(0.0, deadline - time.time()) / 4)
        while True:
            decided = self.cluster.get(f"halt/decision/{g}")
            if decided is not None:
                return int(decided["step"])
            alive = st.topo.alive
            noticed = self._noticed(g)
            if all(w in noticed for w in alive):
                s = max(noticed[w] for w in alive) + 1
                self.cluster.create(f"halt/decision/{g}", {"step": s, "time": time.time()})
                continue  # read what was created (this one or another worker's)
            if st.changed.is_set():
                raise Interrupted("generation changed while agreeing on a halt's save step")
            if time.time() > window_end:
                return None
            time.sleep(POLL_S)

    def _leave_alone(self, step: int) -> NoReturn:
        """Only this worker got a notice: leave at this boundary; the peers fail over."""
        st = self.state
        notice = self.board.notice
        source = notice.source if notice else "?"
        self.halting = True
        st.log(f"{source} notice for this worker alone: leaving at the boundary of step {step}")
        self._declare_dead(st.me, f"left on a {source} preemption notice at step {step}")
        self.board.acknowledge()
        raise Preempted(f"worker {st.me} left on a {source} notice at step {step}")

    def _save_and_leave(self, step: int, deadline: float, source: str) -> NoReturn:
        st = self.state
        g = st.generation
        if self.checkpoint_dir:
            t0 = time.monotonic()
            blocks = [st.owned[b] for b in sorted(st.owned)]
            block_checkpoint.save(self.checkpoint_dir, blocks, step)
            names = [f"block{b.index}-step{step}.pt" for b in blocks]
            size = 0
            for name in names:
                try:
                    size += (Path(self.checkpoint_dir) / name).stat().st_size
                except OSError:
                    pass
            # the checkpoint report line (contract/checkpoints.py): the platform's job
            # record and `rhizome show` list it like the checkpoint SDK's saves
            report = CheckpointReport(
                kind="emergency",
                step=step,
                size_bytes=size,
                time=time.time(),
                learner=str(st.me),
                name=",".join(names)[:200],
            )
            # one write (print writes the newline apart): under the launcher the
            # workers share a stderr pipe, and another's line must not split this one
            sys.stderr.write(report.line() + "\n")
            sys.stderr.flush()
            st.log(
                f"emergency block save of blocks {sorted(st.owned)} at step {step} "
                f"in {time.monotonic() - t0:.2f} s"
            )
        else:
            st.log(f"no checkpoint directory: nothing saved at step {step}")
        self.cluster.put(f"halt/saved/{g}/{st.me}", {"step": step})
        self.board.acknowledge()
        # leave together (a peer may still read this worker's messages of step - 1)
        while time.time() < deadline:
            saved = {int(k.rsplit("/", 1)[1]) for k in self.cluster.get_prefix(f"halt/saved/{g}/")}
            if all(w in saved for w in st.topo.alive):
                break
            time.sleep(POLL_S)
        raise Preempted(f"worker {st.me} saved its blocks at step {step} on a {source} notice")
