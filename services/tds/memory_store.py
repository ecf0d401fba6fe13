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
        self._check()
        with self._lock:
            for line in lines:
                doc_id = log_doc_id(line.job_id, line.learner, line.stream, line.seq)
                copy = tds_pb2.LogLine()
                copy.CopyFrom(line)
                self._logs.setdefault(line.job_id, {})[doc_id] = copy
        return len(lines)

    def write_metrics(self, samples: Sequence[tds_pb2.MetricSample]) -> int:
        self._check()
        with self._lock:
            for s in samples:
                doc_id = metric_doc_id(s.job_id, s.learner, s.source, s.seq)
                copy = tds_pb2.MetricSample()
                copy.CopyFrom(s)
                self._metrics.setdefault(s.job_id, {})[doc_id] = copy
        return len(samples)

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
        plain = Query(query.job_id, query.learner, query.search, query.name, query.since_us)
        out: dict[SeqKey, int] = {}
        for r in self.query_logs(plain):
            out[(r.learner, r.stream)] = max(r.seq, out.get((r.learner, r.stream), -1))
        return out

    def metric_high_water(self, query: Query) -> dict[SeqKey, int]:
        plain = Query(query.job_id, query.learner, query.search, query.name, query.since_us)
        out: dict[SeqKey, int] = {}
        for r in self.query_metrics(plain):
            out[(r.learner, r.source)] = max(r.seq, out.get((r.learner, r.source), -1))
        return out

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


register_store("memory", MemoryStore)
