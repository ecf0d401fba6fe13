"""Fair admission of bulk writes: at most `slots` writes reach the search server at once,
and writers that wait are admitted round-robin by key (a job's learner), so a learner
with a deep backlog cannot crowd out the others. Each collector already keeps only a few
batches in flight (learner/controller/collector.py); this gate is the TDS's side: the
search server sees a bounded number of concurrent bulk requests (beyond a few, a small
server only thrashes) and every learner's next batch gets its turn."""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager


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
    def slot(self, key: Hashable) -> Iterator[None]:
        ticket = object()
        with self._cond:
            self._waiting.setdefault(key, collections.deque()).append(ticket)
            while not (self._free > 0 and self._next() is ticket):
                self._cond.wait()
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
