"""The in-memory dummy twin of the Elasticsearch store, for unit tests and off-cluster use.

Same ordering, id and paging rules as the real store. Full-text search is simplified:
a line matches when it contains every lower-cased word of the query (Elasticsearch's
`match` with operator `and` over the standard analyzer behaves the same on plain words).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from rhizome.v1 import tds_pb2

from services.tds.api import (
    Query,
    SeqKey,
    TrainingDataStore,
    log_doc_id,
    metric_doc_id,
    register_store,
    time_us,
)

_WORD = re.compile(r"\w+")
T = TypeVar("T", tds_pb2.LogLine, tds_pb2.MetricSample)


def words(text: str) -> set[str]:
    return {w.lower() for w in _WORD.findall(text)}


def select(
    records: list[T],
    query: Query,
    key_of: Callable[[T], SeqKey],
    sort_key: Callable[[T], tuple[int, int, str, int]],
    extra: Callable[[T], bool] | None = None,
) -> list[T]:
    """Filter, order and page records exactly as the Query docstring says."""
    out = []
    for rec in records:
        if query.learner is not None and rec.learner != query.learner:
            continue
        if query.since_us is not None and time_us(rec) < query.since_us:
            continue
        key = key_of(rec)
        if key in query.after and rec.seq <= query.after[key]:
            continue
        if extra is not None and not extra(rec):
            continue
        out.append(rec)
    out.sort(key=sort_key)
    if query.pos < 0:
        out = out[max(0, len(out) + query.pos) :]
    elif query.pos > 0:
        out = out[query.pos :]
    if query.page_size > 0:
        out = out[: query.page_size]
    return out


class MemoryStore(TrainingDataStore):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._logs: dict[str, dict[str, tds_pb2.LogLine]] = {}
        self._metrics: dict[str, dict[str, tds_pb2.MetricSample]] = {}
        self._deletions: dict[str, float] = {}
        self.available = True  # unit tests flip this to simulate an outage

    def _check(self) -> None:
        if not self.available:
            from services.tds.api import StoreUnavailable

            raise StoreUnavailable("memory store switched off (test)")

    def ensure_schema(self) -> None:
        self._check()

    def write_logs(self, lines: Sequence[tds_pb2.LogLine]) -> int:
        return self._write(
            self._logs, lines, lambda r: log_doc_id(r.job_id, r.learner, r.stream, r.seq)
        )

    def write_metrics(self, samples: Sequence[tds_pb2.MetricSample]) -> int:
        return self._write(
            self._metrics, samples, lambda r: metric_doc_id(r.job_id, r.learner, r.source, r.seq)
        )

    def _write(
        self, docs: dict[str, dict[str, T]], records: Sequence[T], doc_id: Callable[[T], str]
    ) -> int:
        """Copies of ``records`` by job and document id: a record written again replaces
        its earlier copy, as an indexed document with the same id does."""
        self._check()
        with self._lock:
            for record in records:
                copy = type(record)()
                copy.CopyFrom(record)
                docs.setdefault(record.job_id, {})[doc_id(record)] = copy
        return len(records)

    def query_logs(self, query: Query) -> Iterator[tds_pb2.LogLine]:
        self._check()
        with self._lock:
            records = list(self._logs.get(query.job_id, {}).values())
        wanted = words(query.search) if query.search else None
        return iter(
            select(
                records,
                query,
                key_of=lambda r: (r.learner, r.stream),
                sort_key=lambda r: (time_us(r), r.learner, r.stream, r.seq),
                extra=(lambda r: wanted <= words(r.line)) if wanted else None,
            )
        )

    def query_metrics(self, query: Query) -> Iterator[tds_pb2.MetricSample]:
        self._check()
        with self._lock:
            records = list(self._metrics.get(query.job_id, {}).values())
        return iter(
            select(
                records,
                query,
                key_of=lambda r: (r.learner, r.source),
                sort_key=lambda r: (time_us(r), r.learner, r.source, r.seq),
                extra=(lambda r: r.name == query.name) if query.name else None,
            )
        )

    def log_high_water(self, query: Query) -> dict[SeqKey, int]:
        return _high_water(self.query_logs(_unpaged(query)), lambda r: (r.learner, r.stream))

    def metric_high_water(self, query: Query) -> dict[SeqKey, int]:
        return _high_water(self.query_metrics(_unpaged(query)), lambda r: (r.learner, r.source))

    def count_stored(
        self, kind: str, job_id: str, learner: int, key: str, from_seq: int, to_seq: int
    ) -> int:
        self._check()
        with self._lock:
            if kind == "log":
                docs: list[Any] = list(self._logs.get(job_id, {}).values())
                return sum(
                    1
                    for d in docs
                    if d.learner == learner and d.stream == key and from_seq <= d.seq < to_seq
                )
            docs = list(self._metrics.get(job_id, {}).values())
            return sum(
                1
                for d in docs
                if d.learner == learner and d.source == key and from_seq <= d.seq < to_seq
            )

    def refresh(self, job_id: str) -> None:
        self._check()

    def delete_job(self, job_id: str) -> None:
        self._check()
        with self._lock:
            self._logs.pop(job_id, None)
            self._metrics.pop(job_id, None)

    def schedule_deletion(self, job_id: str, due_s: float) -> None:
        self._check()
        with self._lock:
            self._deletions[job_id] = due_s

    def due_deletions(self, now_s: float) -> list[str]:
        self._check()
        with self._lock:
            return sorted(j for j, due in self._deletions.items() if due <= now_s)

    def clear_deletion(self, job_id: str) -> None:
        with self._lock:
            self._deletions.pop(job_id, None)


def _unpaged(query: Query) -> Query:
    """``query``'s filters without its paging and `after` (every matching record)."""
    return Query(query.job_id, query.learner, query.search, query.name, query.since_us)


def _high_water(records: Iterator[T], key_of: Callable[[T], SeqKey]) -> dict[SeqKey, int]:
    """The highest seq of each key among ``records``."""
    out: dict[SeqKey, int] = {}
    for r in records:
        key = key_of(r)
        out[key] = max(r.seq, out.get(key, -1))
    return out


register_store("memory", MemoryStore)
