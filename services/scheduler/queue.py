"""The job queue: FCFS by priority, largest gang first among jobs submitted together.

Jobs whose arrivals are chained within ``batch_window_s`` of each other form a batch
("submitted together", FfDL §3.6). Order, most urgent first:

    priority (high first) → batch (older first) → gang GPUs (large first)
    → learners (many first) → arrival → enqueue sequence

Each job waits in the pool of its GPU type (``cpu`` for CPU-only jobs). Head-of-line
blocking applies per pool: a K80 job that cannot fit never holds back a V100 job.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

from services.scheduler.api import DEFAULT_BATCH_WINDOW_S, JobRequest

SortKey = tuple[int, int, int, int, float, int]


@dataclass(frozen=True)
class QueueEntry:
    job: JobRequest
    seq: int
    batch: int
    # Computed once: every scheduling pass used to rebuild it for every queued job while
    # sorting (py-spy: up to a third of the daemon's samples with 4,000 jobs queued during
    # benchmarks/api_submit.py). Unique, as `seq` is.
    key: SortKey = field(init=False, compare=False)

    def __post_init__(self) -> None:
        j = self.job
        key = (-j.priority, self.batch, -j.total_gpus, -j.learners, j.arrival, self.seq)
        object.__setattr__(self, "key", key)

    def sort_key(self) -> SortKey:
        return self.key


class JobQueue:
    def __init__(self, batch_window_s: float = DEFAULT_BATCH_WINDOW_S) -> None:
        self.batch_window_s = batch_window_s
        self._entries: dict[str, QueueEntry] = {}
        # Kept sorted as jobs come and go (bisect), so a pass reads the order instead of
        # sorting the whole queue, and "ahead of" is a binary search in the job's pool.
        self._order: list[QueueEntry] = []
        self._keys: list[SortKey] = []
        self._pool_keys: dict[str, list[SortKey]] = {}
        self._next_seq = 0
        self._next_batch = 0
        self._last_arrival: float | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._entries

    def push(
        self, job: JobRequest, *, seq: int | None = None, batch: int | None = None
    ) -> QueueEntry:
        """Queue a job. ``seq``/``batch`` are given when re-queueing or restoring a job."""
        if seq is None:
            seq = self._next_seq
        if batch is None:
            if self._last_arrival is None or job.arrival - self._last_arrival > self.batch_window_s:
                self._next_batch += 1
            batch = self._next_batch
            self._last_arrival = max(job.arrival, self._last_arrival or job.arrival)
        self._next_seq = max(self._next_seq, seq + 1)
        self._next_batch = max(self._next_batch, batch)
        entry = QueueEntry(job, seq, batch)
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
