"""Fair admission of bulk writes: at most `slots` writes reach the search server at once,
and writers that wait are admitted round-robin by key (a job's learner), so a learner
with a deep backlog cannot crowd out the others. Each collector already keeps only a few
batches in flight (learner/controller/collector.py); this gate is the TDS's side: the
search server sees a bounded number of concurrent bulk requests (beyond a few, a small
server only thrashes) and every learner's next batch gets its turn."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

# How often a waiting writer looks whether its caller is still there.
GAVE_UP_POLL_S = 0.25


class CallerGone(Exception):
    """The writer's caller gave up (its deadline passed, or it went away) before its turn."""


class GateBusy(Exception):
    """The writer was not admitted within its longest wait: the store is behind. Its caller
    is told so (and sends the batch again later) instead of waiting until its deadline."""


class FairGate:
    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots is {slots}; it must be >= 1")
        self._cond = threading.Condition()
        self._free = slots
        # Waiting tickets per key; the first key is the next one served (an OrderedDict
        # moved to the end after each admission is the round-robin).
        self._waiting: collections.OrderedDict[Hashable, collections.deque[object]] = (
            collections.OrderedDict()
        )

    def waiting(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._waiting.values())

    def _next(self) -> object | None:
        for queue in self._waiting.values():
            return queue[0]
        return None

    @contextmanager
    def slot(
        self,
        key: Hashable,
        gone: Callable[[], bool] | None = None,
        max_wait_s: float | None = None,
    ) -> Iterator[None]:
        """Hold one of the slots for the block, after the writers ahead in the round-robin.
        `gone()` says the caller gave up: then the writer leaves the line at once, or does
        not start once admitted (CallerGone). Under a backlog a collector's call can wait
        past its deadline; it sends the batch again, and writing the first copy too would
        double the search server's work just when it is the bottleneck. A writer not
        admitted within `max_wait_s` leaves the line (GateBusy): its caller learns that the
        store is behind well before its deadline, so a write is never started for a caller
        about to give up on it."""
        ticket = object()
        until = None if max_wait_s is None else time.monotonic() + max_wait_s
        with self._cond:
            self._waiting.setdefault(key, collections.deque()).append(ticket)
            while True:
                if gone is not None and gone():
                    self._leave(key, ticket)
                    raise CallerGone()
                if self._free > 0 and self._next() is ticket:
                    break
                timeout = GAVE_UP_POLL_S if gone is not None else None
                if until is not None:
                    left = until - time.monotonic()
                    if left <= 0:
                        self._leave(key, ticket)
                        raise GateBusy()
                    timeout = left if timeout is None else min(timeout, left)
                self._cond.wait(timeout)
            queue = self._waiting.pop(key)
            queue.popleft()
            if queue:
                self._waiting[key] = queue  # to the back of the line: the others go first
            self._free -= 1
            self._cond.notify_all()  # the next ticket may be admissible too
        try:
            yield
        finally:
            with self._cond:
                self._free += 1
                self._cond.notify_all()

    def _leave(self, key: Hashable, ticket: object) -> None:
        """Take `ticket` out of the line (under the lock); the next one may go now."""
        queue = self._waiting[key]
        queue.remove(ticket)
        if not queue:
            del self._waiting[key]
        self._cond.notify_all()
