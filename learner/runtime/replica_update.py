"""The replica's updates, applied on one kept thread per worker (issue #24).

The sync phase of step ``s`` receives the reduced gradients that the owner of this
worker's replica block applied, and the step does not end before they are here: after
step ``s`` the replica holds, or has received, the owner's version ``s+1``, which is what
a failover's rendezvous relies on. Applying them — the replica's optimizer step and its
rollback snapshot (``BlockState.apply``), about as much work as the worker's own update —
ran on the step loop, in the next sync phase, on the critical path of every step.
``ReplicaUpdater`` applies them on its one long-lived thread instead, while the step loop
goes on; without eager FRC the worker's updater (``when_idle``) starts one only while a
step thread waits for a message — the next step's first bubble — or something settles
it, not beside the step's first forwards (with eager FRC the step's first FRC needs it
in that bubble, so it starts at once).

The receive itself stays where it was (a kept pool thread the step loop waits on, ``comm``):
a gloo receive cannot be cancelled, and one abandoned on a dead configuration must not
hold the thread that applies the next configuration's updates. Only a received update is
handed over, so an interrupted receive never reaches the replica (it is dropped with its
pool call, as before) and is not an error.

Everything that reads or replaces the replica calls ``settle`` first, which waits until
every handed-over update is applied: eager FRC before the replica's forward, a failover
before it reports versions, promotes the replica or rolls it back, and reconfiguration
(which runs inside the failover's join); the end of the run closes the thread. Fencing: an update
carries the epoch it was received in; one that finds the epoch moved on (a failover
joined without settling it, which the join's order rules out) is discarded, not applied.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch


class Updatable(Protocol):
    """What the updater applies to: ``worker_state.BlockState``."""

    index: int

    def apply(self, reduced: torch.Tensor, step: int) -> None: ...


@dataclass
class _Update:
    block: Updatable | None
    reduced: torch.Tensor | None
    step: int
    epoch: int
    # a task instead of an update (``submit_task``): run, not applied, and started only
    # while a step thread waits or something settles, whatever ``when_idle`` says
    task: Callable[[], None] | None = None


class ReplicaUpdater:
    """Applies handed-over replica updates in order on one kept daemon thread."""

    def __init__(
        self, epoch: Callable[[], int], log: Callable[[str], None], when_idle: bool = False
    ) -> None:
        """``epoch()``: the worker's current epoch (bumped by every failover's join).

        ``when_idle``: start an update only while one of the step's threads waits for a
        message (``idle``) or something settles, not the moment it is handed over: the
        next step's first forwards are the critical path (the successor waits for them),
        and an apply beside them slows them — it competes for the GIL and, with every
        core busy, for a core. In the step's first wait (a 1F1B bubble) it is free.
        """
        self._epoch = epoch
        self._log = log
        self._when_idle = when_idle
        self._idle = 0  # the step's threads waiting for a message now (idle())
        self._forced = 0  # settle() calls waiting now
        self._cv = threading.Condition()
        self._queue: deque[_Update] = deque()
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        # seconds each update took to apply, by the step it belongs to (the profile)
        self.applied_s: dict[int, float] = {}
        # updates dropped by the epoch fence (tests)
        self.discarded = 0

    def submit(self, block: Updatable, reduced: torch.Tensor, step: int, epoch: int) -> None:
        """Hand over the update of ``step``, received in ``epoch``; returns at once.

        Raises the error of an earlier update that failed to apply.
        """
        with self._cv:
            self._raise_error()
            if self._closed:
                raise RuntimeError("replica updater already closed")
            self._queue.append(_Update(block, reduced, step, epoch))
            self._start()
            self._cv.notify_all()

    def _start(self) -> None:
        if self._thread is None:
            # started once, on the first update or task: one thread per worker for the run
            self._thread = threading.Thread(target=self._serve, name="replica-updater", daemon=True)
            self._thread.start()

    def submit_task(self, task: Callable[[], None], epoch: int) -> None:
        """Queue ``task`` behind the updates handed over so far, to run on the updater's
        thread in a wait of the step (``idle``) or when something settles; one whose epoch
        moved on by then is dropped. What the worker can do ahead of time off its critical
        path — the snapshot its own block's next update needs (``BlockState.prepare_snapshot``),
        in the step's first bubble instead of in the sync phase between the step's last
        backward and the next step's first forward."""
        with self._cv:
            self._raise_error()
            if self._closed:
                raise RuntimeError("replica updater already closed")
            self._queue.append(_Update(None, None, -1, epoch, task))
            self._start()
            self._cv.notify_all()

    def settle(self) -> float:
        """Wait until every handed-over update is applied (or discarded); returns the
        seconds waited. Raises the error of an update that failed to apply."""
        with self._cv:
            t0 = time.monotonic()
            self._forced += 1
            self._cv.notify_all()
            try:
                while self._queue or self._busy:
                    self._cv.wait()
            finally:
                self._forced -= 1
            waited = time.monotonic() - t0
            self._raise_error()
            return waited

    @contextlib.contextmanager
    def idle(self) -> Iterator[None]:
        """Around a wait of the step (a receive): queued updates may be applied meanwhile
        (``when_idle``)."""
        with self._cv:
            self._idle += 1
            self._cv.notify_all()
        try:
            yield
        finally:
            with self._cv:
                self._idle -= 1

    def pending(self) -> bool:
        """Whether an update is queued or being applied now."""
        with self._cv:
            return bool(self._queue) or self._busy

    def close(self) -> None:
        """Stop the thread once the queue is empty (the end of the run)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def _may_start(self) -> bool:
        gated = self._when_idle or self._queue[0].task is not None
        return not gated or self._idle > 0 or self._forced > 0

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not (self._queue and self._may_start()):
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._busy = True
            try:
                if job.task is not None:
                    if job.epoch == self._epoch():
                        job.task()
                elif job.epoch != self._epoch():
                    self.discarded += 1
                    self._log(
                        f"discarded the update of step {job.step} of replica block "
                        f"{job.block.index if job.block else '?'}: received in epoch {job.epoch}, now "
                        f"{self._epoch()}"
                    )
                else:
                    assert job.block is not None and job.reduced is not None
                    t0 = time.monotonic()
                    job.block.apply(job.reduced, job.step)
                    self.applied_s[job.step] = time.monotonic() - t0
            except BaseException as exc:
                with self._cv:
                    self._error = exc
                    # later updates build on this one: they cannot apply either
                    self._queue.clear()
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
