"""The `rhizome.v1.TrainingData` servicer: log lines and metrics in, search and follow out.

Follow streams (`follow=True`) work in two layers so that they are both prompt and exact:
- a live feed: every batch this TDS indexes is also published to the open follow
  streams of its job, so a new line reaches a follower right after it is written, without
  polling Elasticsearch;
- the store as the source of truth: a follower tracks, per (learner, stream), the last
  seq it delivered. When a live line is not the next one (the stream started while a
  batch was in flight, a slow follower overflowed its queue, or the line went through
  another TDS replica), it refreshes the job's index and catches up from the store
  before going on; it also catches up every `store_poll_s`. Lines are thus delivered in
  seq order per stream, without gaps or duplicates.
A follow stream ends when the client cancels, or when the injected `job_finished(job_id)`
says so and a grace period has passed (the learners' collectors drain their last batches
then); a final catch-up from the store precedes the end.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from rhizome.v1 import tds_pb2, tds_pb2_grpc

from services import metrics
from services.tds.api import (
    LOG_STREAMS,
    InvalidRequest,
    Query,
    SeqKey,
    StoreRejected,
    StoreUnavailable,
    TDSError,
    TrainingDataStore,
    time_us,
)
from services.tds.fair import CallerGone, FairGate, GateBusy

log = logging.getLogger(__name__)
# The longest a batch waits for a write slot before its caller is answered
# RESOURCE_EXHAUSTED. With the search client's timeout (es_store.REQUEST_TIMEOUT_S) it
# bounds how long the TDS takes to answer a write, and a collector's deadline for a write
# (learner/controller/collector.py WRITE_TIMEOUT_S) is longer than both together: a
# collector never gives up on, and sends again, a batch the search server is still
# writing (the second copy doubled the work of a server that was already behind).
MAX_WRITE_WAIT_S = 30.0
R = TypeVar("R", tds_pb2.LogLine, tds_pb2.MetricSample)
JobFinished = Callable[[str], bool]


class _Subscription:
    def __init__(self, maxsize: int) -> None:
        self.queue: queue.Queue[Sequence[Any] | None] = queue.Queue(maxsize=maxsize)
        self.overflowed = False


class Broker:
    """Fans freshly indexed records out to the follow streams of their job."""

    def __init__(self, max_batches: int = 256) -> None:
        self._lock = threading.Lock()
        self._subs: dict[str, list[_Subscription]] = {}
        self._max = max_batches

    def subscribe(self, job_id: str) -> _Subscription:
        sub = _Subscription(self._max)
        with self._lock:
            self._subs.setdefault(job_id, []).append(sub)
        return sub

    def unsubscribe(self, job_id: str, sub: _Subscription) -> None:
        with self._lock:
            subs = self._subs.get(job_id, [])
            if sub in subs:
                subs.remove(sub)
            if not subs:
                self._subs.pop(job_id, None)

    def publish(self, job_id: str, records: Sequence[Any]) -> None:
        with self._lock:
            subs = list(self._subs.get(job_id, ()))
        for sub in subs:
            try:
                sub.queue.put_nowait(records)
            except queue.Full:
                # A slow reader: drop the live copy; it catches up from the store.
                sub.overflowed = True

    @staticmethod
    def wake(sub: _Subscription) -> None:
        try:
            sub.queue.put_nowait(None)
        except queue.Full:
            pass


def _by_job(records: Sequence[R]) -> dict[str, list[R]]:
    out: dict[str, list[R]] = {}
    for r in records:
        out.setdefault(r.job_id, []).append(r)
    return out


class TrainingDataServicer(tds_pb2_grpc.TrainingDataServicer):
    def __init__(
        self,
        store: TrainingDataStore,
        job_finished: JobFinished | None = None,
        *,
        retention_s: float = 0.0,
        follow_poll_s: float = 0.25,
        store_poll_s: float = 2.0,
        finish_grace_s: float = 1.0,
        sweep_interval_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        job_scope: Callable[[grpc.ServicerContext], str] | None = None,
        on_metrics: Callable[[Sequence[tds_pb2.MetricSample]], None] | None = None,
        on_logs: Callable[[Sequence[tds_pb2.LogLine]], object] | None = None,
        max_bulk_in_flight: int = 4,
        max_write_wait_s: float = MAX_WRITE_WAIT_S,
    ) -> None:
        """`job_finished` is called about every `follow_poll_s` by each follow stream;
        None means follow streams end only when the client cancels. `retention_s` is how
        long DeleteJobData waits before deleting (0: at once). `job_scope(context)` names
        the one job a call's credential is confined to (a learner's job token), or ""
        (services/security/internal.py). `on_metrics(samples)` sees every batch the store
        accepted (the jobs' last values, services/tds/last_metrics.py); `on_logs(lines)` every
        batch of log lines (checkpoint reports, services/tds/checkpoints.py).
        `max_bulk_in_flight`: writes to the store at once, waiting ones admitted
        round-robin by learner (services/tds/fair.py); one that waits `max_write_wait_s`
        without its turn is answered RESOURCE_EXHAUSTED (see MAX_WRITE_WAIT_S)."""
        self.store = store
        self.write_gate = FairGate(max_bulk_in_flight)
        self.max_write_wait_s = max_write_wait_s
        self.on_metrics = on_metrics
        self.on_logs = on_logs
        self.job_scope = job_scope
        self.job_finished = job_finished
        self.retention_s = retention_s
        self.follow_poll_s = follow_poll_s
        self.store_poll_s = store_poll_s
        self.finish_grace_s = finish_grace_s
        self.sweep_interval_s = sweep_interval_s
        self.clock = clock
        self.log_broker = Broker()
        self.metric_broker = Broker()
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------
    def start_sweeper(self) -> None:
        """Delete the data of jobs whose retention has passed, now and every interval."""
        if self._sweeper is None:
            self._sweeper = threading.Thread(
                target=self._sweep_loop, name="tds-sweeper", daemon=True
            )
            self._sweeper.start()

    def _sweep_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sweep()
            except TDSError as exc:
                log.warning("retention sweep failed, will retry: %s", exc)
            self._stop.wait(self.sweep_interval_s)

    def sweep(self) -> list[str]:
        """Delete every job whose deletion is due; return their ids."""
        done = []
        for job_id in self.store.due_deletions(self.clock()):
            self.store.delete_job(job_id)
            self.store.clear_deletion(job_id)
            done.append(job_id)
        return done

    def close(self) -> None:
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join(timeout=5)

    # -- who may touch which job -------------------------------------------------------
    def _confine(self, context: grpc.ServicerContext, job_ids: Iterable[str], what: str) -> None:
        """A call carrying a job token touches its own job only (PERMISSION_DENIED)."""
        scope = self.job_scope(context) if self.job_scope is not None else ""
        if not scope:
            return
        for job_id in job_ids:
            if job_id != scope:
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"this job token belongs to job {scope}; it cannot {what} job {job_id[:128]}",
                )

    # -- writes ---------------------------------------------------------------------
    def AddLogLines(
        self, request: tds_pb2.AddLogLinesRequest, context: grpc.ServicerContext
    ) -> tds_pb2.AddResponse:
        lines = request.lines
        for i, ln in enumerate(lines):
            problem = None
            if not ln.job_id:
                problem = "job_id is empty"
            elif ln.stream not in LOG_STREAMS:
                problem = f"stream {ln.stream!r} is not one of {list(LOG_STREAMS)}"
            elif ln.learner < 0 or ln.seq < 0:
                problem = f"learner ({ln.learner}) and seq ({ln.seq}) must be >= 0"
            if problem:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lines[{i}]: {problem}")
        return self._accept(
            context, lines, "log", self.store.write_logs, self.log_broker, self.on_logs
        )

    def AddMetrics(
        self, request: tds_pb2.AddMetricsRequest, context: grpc.ServicerContext
    ) -> tds_pb2.AddResponse:
        samples = request.samples
        for i, s in enumerate(samples):
            problem = None
            if not s.job_id:
                problem = "job_id is empty"
            elif not s.name:
                problem = "name is empty"
            elif not s.source:
                problem = "source is empty (logger, regex_extractor, emetrics_file, tensorboard)"
            elif s.learner < 0 or s.seq < 0:
                problem = f"learner ({s.learner}) and seq ({s.seq}) must be >= 0"
            if problem:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"samples[{i}]: {problem}")
        return self._accept(
            context,
            samples,
            "metric",
            self.store.write_metrics,
            self.metric_broker,
            self.on_metrics,
        )

    def _accept(
        self,
        context: grpc.ServicerContext,
        records: Sequence[R],
        kind: str,
        write: Callable[[Any], int],
        broker: Broker,
        on_accepted: Callable[[Sequence[R]], object] | None,
    ) -> tds_pb2.AddResponse:
        """A validated batch of log lines or metric samples (`kind` "log" or "metric"): the
        caller's own job only, written under its learner's fair-share slot, counted, live to
        the job's followers, then seen by `on_logs`/`on_metrics`."""
        self._confine(context, {r.job_id for r in records}, f"write the {kind}s of")
        key = (records[0].job_id, records[0].learner) if records else ("", 0)
        try:
            with self.write_gate.slot(
                key, gone=lambda: not context.is_active(), max_wait_s=self.max_write_wait_s
            ):
                n = self._write(context, write, records)
        except CallerGone:
            # Nobody waits for this answer; the collector sends the batch again.
            metrics.TDS_WRITES_ABANDONED.labels(kind).inc()
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the caller gave up before its turn")
        except GateBusy:
            # Back-pressure: nothing was written; the collector sends the batch again after
            # a backoff, long before its own deadline.
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the search server is behind: no write slot within {self.max_write_wait_s:g} s "
                f"({self.write_gate.waiting()} batches waiting); retry later",
            )
        metrics.TDS_DOCUMENTS.labels(kind).inc(n)
        for job_id, recs in _by_job(records).items():
            broker.publish(job_id, recs)
        if on_accepted is not None:
            on_accepted(records)
        return tds_pb2.AddResponse(accepted=n)

    @staticmethod
    def _write(context: grpc.ServicerContext, fn: Callable[[Any], int], records: Any) -> int:
        try:
            return fn(records)
        except StoreUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc}; retry later")
        except StoreRejected as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise AssertionError("unreachable")  # pragma: no cover - abort raises

    def DeleteJobData(
        self, request: tds_pb2.DeleteJobDataRequest, context: grpc.ServicerContext
    ) -> tds_pb2.AddResponse:
        if not request.job_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "job_id is empty")
        if self.job_scope is not None and self.job_scope(context):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "a job token cannot delete logs")
        try:
            if self.retention_s <= 0:
                self.store.delete_job(request.job_id)
                self.store.clear_deletion(request.job_id)
            else:
                self.store.schedule_deletion(request.job_id, self.clock() + self.retention_s)
        except StoreUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc}; retry later")
        return tds_pb2.AddResponse(accepted=1)

    def CountStored(
        self, request: tds_pb2.CountStoredRequest, context: grpc.ServicerContext
    ) -> tds_pb2.CountStoredResponse:
        if not request.job_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "job_id is empty")
        if request.learner < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"learner {request.learner} < 0")
        self._confine(context, [request.job_id], "count the records of")
        resp = tds_pb2.CountStoredResponse()
        try:
            for kind, ranges, out in (
                ("log", request.log_ranges, resp.log_counts),
                ("metric", request.metric_ranges, resp.metric_counts),
            ):
                for i, r in enumerate(ranges):
                    if not r.key or r.from_seq < 0 or r.to_seq < r.from_seq:
                        context.abort(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"{kind}_ranges[{i}]: need a key and 0 <= from_seq <= to_seq",
                        )
                    out.append(
                        self.store.count_stored(
                            kind, request.job_id, request.learner, r.key, r.from_seq, r.to_seq
                        )
                    )
        except StoreUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc}; retry later")
        except StoreRejected as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return resp

    # -- reads ----------------------------------------------------------------------
    @staticmethod
    def _query(request: tds_pb2.LogsRequest | tds_pb2.MetricsRequest) -> Query:
        if not request.job_id:
            raise InvalidRequest("job_id is empty: name the job whose data you want")
        if request.learner < -1:
            raise InvalidRequest(f"learner {request.learner}: use -1 for all learners or >= 0")
        if request.page_size < 0:
            raise InvalidRequest(f"page_size {request.page_size}: use 0 (no limit) or > 0")
        since = None
        if request.HasField("since"):
            try:
                since = request.since.ToMicroseconds()  # checks the range a Timestamp may hold
            except ValueError as exc:
                raise InvalidRequest(f"since: {exc}") from None
        return Query(
            job_id=request.job_id,
            learner=None if request.learner == -1 else request.learner,
            search=getattr(request, "search", "") or None,
            name=getattr(request, "name", "") or None,
            since_us=since,
            pos=request.pos,
            page_size=request.page_size,
        )

    def GetLogs(
        self, request: tds_pb2.LogsRequest, context: grpc.ServicerContext
    ) -> Iterator[tds_pb2.LogLine]:
        def live_match(q: Query) -> Callable[[tds_pb2.LogLine], bool] | None:
            if q.search:
                return None  # full-text matching is the store's: poll it instead
            return lambda r: _plain_match(q, r)

        yield from self._serve(
            request,
            context,
            kind="log",
            query_fn=self.store.query_logs,
            key_of=lambda r: (r.learner, r.stream),
            live_match=live_match,
            broker=self.log_broker,
            high_water=self.store.log_high_water,
        )

    def GetMetrics(
        self, request: tds_pb2.MetricsRequest, context: grpc.ServicerContext
    ) -> Iterator[tds_pb2.MetricSample]:
        def live_match(q: Query) -> Callable[[tds_pb2.MetricSample], bool]:
            return lambda r: _plain_match(q, r) and (not q.name or r.name == q.name)

        yield from self._serve(
            request,
            context,
            kind="metric",
            query_fn=self.store.query_metrics,
            key_of=lambda r: (r.learner, r.source),
            live_match=live_match,
            broker=self.metric_broker,
            high_water=self.store.metric_high_water,
        )

    def _serve(
        self,
        request: Any,
        context: grpc.ServicerContext,
        *,
        kind: str,
        query_fn: Callable[[Query], Iterator[R]],
        key_of: Callable[[R], SeqKey],
        live_match: Callable[[Query], Callable[[R], bool] | None],
        broker: Broker,
        high_water: Callable[[Query], dict[SeqKey, int]],
    ) -> Iterator[R]:
        try:
            query = self._query(request)
        except InvalidRequest as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._confine(context, [request.job_id], f"read the {kind}s of")
        try:
            if not request.follow:
                # A one-off read must see every acknowledged line: a failed job's last
                # lines right after it failed, metrics right after the job ended. Stores
                # make writes searchable on an interval (and noida-db only on the next
                # write), so refresh this job's indices first; a read is not a hot path.
                self.store.refresh(query.job_id)
                yield from query_fn(query)
                return
            metrics.TDS_FOLLOWERS.labels(kind).inc()
            try:
                yield from self._follow(
                    context, query, query_fn, key_of, live_match(query), broker, high_water
                )
            finally:
                metrics.TDS_FOLLOWERS.labels(kind).dec()
        except StoreUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc}; retry later")
        except StoreRejected as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def _finished(self, job_id: str) -> bool:
        if self.job_finished is None:
            return False
        try:
            return bool(self.job_finished(job_id))
        except Exception as exc:  # the jobs repository is down: keep following
            log.warning("job_finished(%s) failed, still following: %s", job_id, exc)
            return False

    def _follow(
        self,
        context: grpc.ServicerContext,
        query: Query,
        query_fn: Callable[[Query], Iterator[R]],
        key_of: Callable[[R], SeqKey],
        match: Callable[[R], bool] | None,
        broker: Broker,
        high_water: Callable[[Query], dict[SeqKey, int]],
    ) -> Iterator[R]:
        sub = broker.subscribe(query.job_id)
        context.add_callback(lambda: Broker.wake(sub))
        try:
            delivered: dict[SeqKey, int] = {}
            # Only a gap-free view (no time or text filter) can tell a missing line.
            exact = match is not None and query.since_us is None
            history_complete = query.pos == 0 and query.page_size == 0
            if not history_complete:
                # The user asked for a window of the past (e.g. the last 10 lines); what
                # follows must start after everything that exists now, not after the window.
                delivered.update(high_water(self._plain(query)))
            for rec in query_fn(query):
                if not context.is_active():
                    return
                k = key_of(rec)
                delivered[k] = max(rec.seq, delivered.get(k, -1))
                yield rec

            def catch_up(refresh: bool) -> Iterator[R]:
                if refresh:
                    self.store.refresh(query.job_id)
                tail = Query(
                    job_id=query.job_id,
                    learner=query.learner,
                    search=query.search,
                    name=query.name,
                    since_us=query.since_us,
                    after=dict(delivered),
                )
                for r in query_fn(tail):
                    k = key_of(r)
                    if r.seq > delivered.get(k, -1):
                        delivered[k] = r.seq
                        yield r

            # The store may hold lines written between the history query and subscribing.
            yield from catch_up(refresh=True)
            last_poll = last_check = time.monotonic()
            finished_at: float | None = None
            dirty = False  # the store holds records the live feed could not deliver
            while context.is_active():
                try:
                    batch = sub.queue.get(timeout=self.follow_poll_s)
                except queue.Empty:
                    batch = None
                if batch is not None:
                    if match is None:
                        dirty = True
                    else:
                        pending: list[R] = []
                        for r in batch:
                            if not match(r):
                                continue
                            k = key_of(r)
                            d = delivered.get(k, -1)
                            if r.seq <= d:
                                continue
                            if pending or (exact and r.seq != d + 1):
                                pending.append(r)
                                continue
                            delivered[k] = r.seq
                            yield r
                        if pending:
                            yield from catch_up(refresh=True)
                            for r in pending:
                                k = key_of(r)
                                if r.seq > delivered.get(k, -1):
                                    delivered[k] = r.seq
                                    yield r
                if sub.overflowed:
                    sub.overflowed = False
                    dirty = True
                now = time.monotonic()
                # At most one store round trip per poll interval, however fast lines come.
                if (dirty and now - last_poll >= self.follow_poll_s) or (
                    now - last_poll >= self.store_poll_s
                ):
                    yield from catch_up(refresh=dirty)
                    last_poll, dirty = now, False
                if not context.is_active():
                    return
                if finished_at is None:
                    if now - last_check >= self.follow_poll_s:
                        last_check = now
                        if self._finished(query.job_id):
                            finished_at = now
                elif now - finished_at >= self.finish_grace_s:
                    yield from catch_up(refresh=True)
                    return
        finally:
            broker.unsubscribe(query.job_id, sub)

    @staticmethod
    def _plain(query: Query) -> Query:
        return Query(
            job_id=query.job_id,
            learner=query.learner,
            search=query.search,
            name=query.name,
            since_us=query.since_us,
        )


def _plain_match(q: Query, r: tds_pb2.LogLine | tds_pb2.MetricSample) -> bool:
    if q.learner is not None and r.learner != q.learner:
        return False
    return q.since_us is None or time_us(r) >= q.since_us
