"""The job queue: FCFS by priority, largest gang first among jobs submitted together
(the default), or the order a scaling policy gives it (``QueueOrder``).

Jobs whose arrivals are chained within ``batch_window_s`` of each other form a batch
("submitted together", FfDL §3.6). Order, most urgent first:

    priority (high first) → batch (older first) → gang GPUs (large first)
    → learners (many first) → arrival → enqueue sequence

Each job waits in the pool of its GPU type (``cpu`` for CPU-only jobs). Head-of-line
blocking applies per pool: a K80 job that cannot fit never holds back a V100 job.

A scaling policy that orders the queue itself (a ``QueueOrder``: Elastic-Tiresias orders
it by the GPU·s each job attained, services/scheduler/elasticity/tiresias.py) supplies
the key instead. The key is computed once, when a job is pushed (queued, re-queued after
a preemption, restored): a queued job attains nothing, so it cannot go stale while the
job waits, and the queue stays bisect-sorted.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

from services.scheduler.api import DEFAULT_BATCH_WINDOW_S, JobRequest

# Numbers, most significant first; every key of one queue has the same shape and ends
# with the entry's unique `seq`, so keys are unique and totally ordered.
SortKey = tuple[float, ...]


def default_key(job: JobRequest, seq: int, batch: int) -> SortKey:
    """FCFS by priority, largest gang first among jobs submitted together."""
    return (-job.priority, batch, -job.total_gpus, -job.learners, job.arrival, seq)


@dataclass(frozen=True)
class QueueEntry:
    job: JobRequest
    seq: int
    batch: int
    # GPU·s the job attained in its earlier placements (the scheduler's JobRecord): what
    # a service-ordered queue (Tiresias) sorts by
    attained_gpu_s: float = 0.0
    # Computed once, by the queue when it pushes the entry: every scheduling pass used to
    # rebuild it for every queued job while sorting (py-spy: up to a third of the daemon's
    # samples with 4,000 jobs queued during benchmarks/api_submit.py). Unique, as `seq` is.
    key: SortKey = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", default_key(self.job, self.seq, self.batch))

    def sort_key(self) -> SortKey:
        return self.key


@runtime_checkable
class QueueOrder(Protocol):
    """A scaling policy that orders the queue (the one hook): ``queue_key`` is the entry's
    sort key, smallest first, ending with ``entry.seq`` (unique); ``queue_note`` is what
    ``rhizome show`` says about the entry's place in that order."""

    def queue_key(self, entry: QueueEntry) -> SortKey: ...

    def queue_note(self, entry: QueueEntry) -> str: ...


class JobQueue:
    def __init__(
        self, batch_window_s: float = DEFAULT_BATCH_WINDOW_S, order: QueueOrder | None = None
    ) -> None:
        self.batch_window_s = batch_window_s
        self.order = order
        self._entries: dict[str, QueueEntry] = {}
        # Kept sorted as jobs come and go (bisect), so a pass reads the order instead of
        # sorting the whole queue, and "ahead of" is a binary search in the job's pool.
        self._order: list[QueueEntry] = []
        self._keys: list[SortKey] = []
        self._pool_keys: dict[str, list[SortKey]] = {}
        # Jobs that left the queue or were put back in so far (a new job queued is not
        # counted): GangScheduler._fingerprint.
        self.changes = 0
        self._next_seq = 0
        self._next_batch = 0
        self._last_arrival: float | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._entries

    def push(
        self,
        job: JobRequest,
        *,
        seq: int | None = None,
        batch: int | None = None,
        attained_gpu_s: float = 0.0,
    ) -> QueueEntry:
        """Queue a job. ``seq``/``batch`` are given when re-queueing or restoring a job;
        ``attained_gpu_s`` is the service it attained so far (its key is computed here,
        from it, once per push)."""
        if seq is None:
            seq = self._next_seq
        if batch is None:
            if self._last_arrival is None or job.arrival - self._last_arrival > self.batch_window_s:
                self._next_batch += 1
            batch = self._next_batch
            self._last_arrival = max(job.arrival, self._last_arrival or job.arrival)
        self._next_seq = max(self._next_seq, seq + 1)
        self._next_batch = max(self._next_batch, batch)
        entry = QueueEntry(job, seq, batch, attained_gpu_s)
        if self.order is not None:
            entry = replace(entry, key=self.order.queue_key(entry))
        self.remove(job.job_id)  # a re-push replaces the job's entry
        self._entries[job.job_id] = entry
        at = bisect.bisect_left(self._keys, entry.key)
        self._keys.insert(at, entry.key)
        self._order.insert(at, entry)
        bisect.insort(self._pool_keys.setdefault(job.pool, []), entry.key)
        return entry

    def remove(self, job_id: str) -> QueueEntry | None:
        entry = self._entries.pop(job_id, None)
        if entry is not None:
            self.changes += 1
            at = bisect.bisect_left(self._keys, entry.key)
            del self._keys[at], self._order[at]
            pool = self._pool_keys[entry.job.pool]
            del pool[bisect.bisect_left(pool, entry.key)]
            if not pool:
                del self._pool_keys[entry.job.pool]
        return entry

    def get(self, job_id: str) -> QueueEntry | None:
        return self._entries.get(job_id)

    def ordered(self) -> list[QueueEntry]:
        return list(self._order)

    def head(self, n: int) -> list[QueueEntry]:
        """The first ``n`` entries in order."""
        return self._order[:n]

    def last_key(self) -> SortKey | None:
        """The key of the last entry in order (None: the queue is empty)."""
        return self._keys[-1] if self._keys else None

    def by_pool(self) -> dict[str, list[QueueEntry]]:
        pools: dict[str, list[QueueEntry]] = {}
        for entry in self.ordered():
            pools.setdefault(entry.job.pool, []).append(entry)
        return dict(sorted(pools.items()))

    def ahead_of(self, job_id: str) -> int:
        """Jobs ahead of this one in its pool."""
        entry = self._entries[job_id]
        return bisect.bisect_left(self._pool_keys[entry.job.pool], entry.key)

    def __iter__(self) -> Iterator[QueueEntry]:
        return iter(self.ordered())
