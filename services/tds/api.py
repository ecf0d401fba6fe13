"""The training data store: what the TDS needs from a search backend, and its typed errors.

Modelled on torch.distributed.elastic's rendezvous API: one abstract class, typed
exceptions, and backends registered by name (`elasticsearch` for real use, `memory`
as the dummy twin for unit tests and off-cluster runs).

Ordering and identity are exact, never approximate:
- a log line is identified by (job_id, learner, stream, seq) and stored under the
  document id `f"{job_id}-{learner}-{stream}-{seq}"`, so a batch sent twice (a collector
  or TDS restart) overwrites itself instead of adding duplicates;
- a metric sample is identified by (job_id, learner, source, seq) and stored under
  `f"{job_id}-{learner}-metrics-{source}-{seq}"`;
- results are ordered by (time, learner, stream|source, seq): time first so that the
  learners interleave as they printed, the rest to break ties the same way every time.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rhizome.v1 import tds_pb2

# The streams a log line may name; re-exported for the servicer, defined in the contract.
from contract.logs import LOG_STREAMS as LOG_STREAMS
from contract.registry import Registry

# (learner, stream) for logs, (learner, source) for metrics: the unit within which
# seq numbers are contiguous.
SeqKey = tuple[int, str]


class TDSError(RuntimeError):
    """Base class of every error the training data service raises on purpose."""


class InvalidRequest(TDSError, ValueError):
    """A request the TDS refuses; the message names the field and how to fix it."""


class StoreUnavailable(TDSError):
    """The backend cannot be reached right now; the caller should retry later."""


class StoreRejected(TDSError):
    """The backend refused the data itself (a mapping error); retrying will not help."""


def log_doc_id(job_id: str, learner: int, stream: str, seq: int) -> str:
    return f"{job_id}-{learner}-{stream}-{seq}"


def metric_doc_id(job_id: str, learner: int, source: str, seq: int) -> str:
    return f"{job_id}-{learner}-metrics-{source}-{seq}"


def time_us(msg: tds_pb2.LogLine | tds_pb2.MetricSample) -> int:
    """The message's timestamp in microseconds since the epoch (ES keeps milliseconds
    in its date field, so the exact value lives in a long field beside it)."""
    return int(msg.time.seconds) * 1_000_000 + int(msg.time.nanos) // 1000


def set_time_us(msg: tds_pb2.LogLine | tds_pb2.MetricSample, us: int) -> None:
    msg.time.seconds = us // 1_000_000
    msg.time.nanos = (us % 1_000_000) * 1000


@dataclass(frozen=True)
class Query:
    """What GetLogs / GetMetrics ask of the store.

    `pos` >= 0 skips that many records from the start; `pos` < 0 starts `-pos` records
    before the end (FfDL). `page_size` 0 means no limit. `after` maps a SeqKey to the
    last seq already delivered: only later records of that key, and records of keys not
    in the map, are returned (used by follow streams to catch up).
    """

    job_id: str
    learner: int | None = None
    search: str | None = None  # logs: full-text over the line
    name: str | None = None  # metrics: exact metric name
    since_us: int | None = None
    pos: int = 0
    page_size: int = 0
    after: Mapping[SeqKey, int] = field(default_factory=dict)


class TrainingDataStore(abc.ABC):
    """Where log lines and metric samples live. Implementations must be thread-safe."""

    @abc.abstractmethod
    def ensure_schema(self) -> None:
        """Create templates/mappings/indices if missing; safe to call on every start."""

    @abc.abstractmethod
    def write_logs(self, lines: Sequence[tds_pb2.LogLine]) -> int:
        """Index the lines idempotently; return how many were written. Raises
        StoreUnavailable or StoreRejected."""

    @abc.abstractmethod
    def write_metrics(self, samples: Sequence[tds_pb2.MetricSample]) -> int: ...

    @abc.abstractmethod
    def query_logs(self, query: Query) -> Iterator[tds_pb2.LogLine]:
        """Lines in (time, learner, stream, seq) order, after pos/page_size."""

    @abc.abstractmethod
    def query_metrics(self, query: Query) -> Iterator[tds_pb2.MetricSample]:
        """Samples in (time, learner, source, seq) order, after pos/page_size."""

    @abc.abstractmethod
    def log_high_water(self, query: Query) -> dict[SeqKey, int]:
        """The highest seq per (learner, stream) among the lines the query selects
        (pos, page_size and after are ignored)."""

    @abc.abstractmethod
    def metric_high_water(self, query: Query) -> dict[SeqKey, int]:
        """The highest seq per (learner, source) among the samples the query selects."""

    @abc.abstractmethod
    def count_stored(
        self, kind: str, job_id: str, learner: int, key: str, from_seq: int, to_seq: int
    ) -> int:
        """How many records of `kind` ('log' or 'metric') the store holds for this learner
        and key (stream or source) with from_seq <= seq < to_seq, refreshed or not."""

    @abc.abstractmethod
    def refresh(self, job_id: str) -> None:
        """Make everything written so far searchable now (near-real-time backends)."""

    @abc.abstractmethod
    def delete_job(self, job_id: str) -> None:
        """Delete every log line and metric sample of the job (no error if none)."""

    @abc.abstractmethod
    def schedule_deletion(self, job_id: str, due_s: float) -> None:
        """Remember, durably, that the job's data must be deleted at `due_s` (epoch s)."""

    @abc.abstractmethod
    def due_deletions(self, now_s: float) -> list[str]:
        """Job ids whose scheduled deletion is due."""

    @abc.abstractmethod
    def clear_deletion(self, job_id: str) -> None: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


def _load_builtin() -> None:
    # Importing the backends registers them; done on first use so `api` stays import-light.
    from services.tds import es_store, memory_store  # noqa: F401


STORES: Registry[Callable[..., TrainingDataStore]] = Registry(
    "training data store", error=InvalidRequest, load=_load_builtin
)


def register_store(name: str, factory: Callable[..., TrainingDataStore] | str) -> None:
    STORES.register(name, factory)


def create_store(name: str, **kwargs: Any) -> TrainingDataStore:
    """A store backend by name: 'elasticsearch' (url=...) or 'memory'."""
    return STORES.get(name)(**kwargs)
