"""The TrainingData servicer over real gRPC, backed by the in-memory store (unit tests)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from rhizome.v1 import tds_pb2

from services.tds.memory_store import MemoryStore
from services.tds.servicer import TrainingDataServicer
from tests.services.tds.helpers import log_line, stub, tds_in_process

T0 = 1_700_000_000_000_000


def _lines(job: str, learner: int, stream: str, n: int, start: int = 0) -> list[tds_pb2.LogLine]:
    return [
        log_line(job, learner, stream, i, f"{stream} line {i} of learner {learner}", T0 + i * 10)
        for i in range(start, start + n)
    ]


Tds = tuple[str, TrainingDataServicer]


@contextlib.contextmanager
def _refused_behind_a_backlog(
    servicer: TrainingDataServicer, s: Any, job: str, timeout: float
) -> Iterator[grpc.RpcError]:
    """While every write slot of the TDS is held (as under a backlog): the error a write of
    3 lines of `job` with this timeout got."""
    with contextlib.ExitStack() as slots:
        for k in range(4):
            slots.enter_context(servicer.write_gate.slot(("other", k)))
        with pytest.raises(grpc.RpcError) as raised:
            s.AddLogLines(
                tds_pb2.AddLogLinesRequest(lines=_lines(job, 0, "stdout", 3)), timeout=timeout
            )
        yield raised.value


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def finished() -> set[str]:
    return set()


@pytest.fixture
def tds(store: MemoryStore, finished: set[str]) -> Iterator[Tds]:
    with tds_in_process(
        store, lambda job: job in finished, follow_poll_s=0.05, finish_grace_s=0.2
    ) as (addr, servicer):
        yield addr, servicer


def test_lines_come_back_in_time_then_learner_order_with_learner_filter(tds: Tds) -> None:
    addr, _ = tds
    channel, s = stub(addr)
    s.AddLogLines(tds_pb2.AddLogLinesRequest(lines=_lines("j", 1, "stdout", 3)))
    s.AddLogLines(tds_pb2.AddLogLinesRequest(lines=_lines("j", 0, "stdout", 3)))
    got = [(ln.learner, ln.seq) for ln in s.GetLogs(tds_pb2.LogsRequest(job_id="j", learner=-1))]
    assert got == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    only1 = [ln.learner for ln in s.GetLogs(tds_pb2.LogsRequest(job_id="j", learner=1))]
    assert only1 == [1, 1, 1]
    channel.close()


def test_resending_a_batch_does_not_duplicate(tds: Tds, store: MemoryStore) -> None:
    addr, _ = tds
    channel, s = stub(addr)
    batch = tds_pb2.AddLogLinesRequest(lines=_lines("j", 0, "stdout", 5))
    s.AddLogLines(batch)
    s.AddLogLines(batch)
    assert len(list(s.GetLogs(tds_pb2.LogsRequest(job_id="j", learner=-1)))) == 5
    channel.close()


def test_pos_and_page_size_page_like_ffdl_with_negative_pos_from_the_end(tds: Tds) -> None:
    addr, _ = tds
    channel, s = stub(addr)
    s.AddLogLines(tds_pb2.AddLogLinesRequest(lines=_lines("j", 0, "stdout", 10)))

    def seqs(pos: int = 0, page_size: int = 0) -> list[int]:
        req = tds_pb2.LogsRequest(job_id="j", learner=-1, pos=pos, page_size=page_size)
        return [ln.seq for ln in s.GetLogs(req)]

    assert seqs(pos=2, page_size=3) == [2, 3, 4]
    assert seqs(pos=-3) == [7, 8, 9]
    assert seqs(pos=-3, page_size=2) == [7, 8]
    assert seqs(pos=20) == []
    channel.close()


def test_search_and_since_filter_lines(tds: Tds) -> None:
    addr, _ = tds
    channel, s = stub(addr)
    s.AddLogLines(tds_pb2.AddLogLinesRequest(lines=_lines("j", 0, "stdout", 10)))
    found = [
        ln.seq for ln in s.GetLogs(tds_pb2.LogsRequest(job_id="j", learner=-1, search="line 7"))
    ]
    assert found == [7]
    req = tds_pb2.LogsRequest(job_id="j", learner=-1)
    req.since.FromMicroseconds(T0 + 80)
    assert [ln.seq for ln in s.GetLogs(req)] == [8, 9]
    channel.close()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (tds_pb2.LogLine(job_id="", stream="stdout"), "job_id is empty"),
        (tds_pb2.LogLine(job_id="j", stream="stdlog"), "stream 'stdlog'"),
        (tds_pb2.LogLine(job_id="j", stream="stdout", seq=-1), "must be >= 0"),
    ],
)
def test_bad_lines_are_refused_with_the_field_named(
    tds: Tds, line: tds_pb2.LogLine, message: str
) -> None:
    addr, _ = tds
    channel, s = stub(addr)
    with pytest.raises(grpc.RpcError) as err:
        s.AddLogLines(tds_pb2.AddLogLinesRequest(lines=[line]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.value.details() or "")
    channel.close()


def test_store_outage_is_unavailable_so_collectors_retry(tds: Tds, store: MemoryStore) -> None:
    addr, _ = tds
    channel, s = stub(addr)
    store.available = False
    with pytest.raises(grpc.RpcError) as err:
        s.AddLogLines(tds_pb2.AddLogLinesRequest(lines=_lines("j", 0, "stdout", 1)))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()


def test_follow_delivers_history_then_new_lines_and_ends_with_the_job(
    tds: Tds, finished: set[str]
) -> None:
    addr, _ = tds
    channel, s = stub(addr)
    s.AddLogLines(tds_pb2.AddLogLinesRequest(lines=_lines("j", 0, "stdout", 3)))
    got: list[int] = []
    first_live = threading.Event()

    def follow() -> None:
        for ln in s.GetLogs(tds_pb2.LogsRequest(job_id="j", learner=-1, follow=True)):
            got.append(ln.seq)
            if ln.seq == 3:
                first_live.set()

    t = threading.Thread(target=follow)
    t.start()
    s.AddLogLines(tds_pb2.AddLogLinesRequest(lines=_lines("j", 0, "stdout", 2, start=3)))
    assert first_live.wait(10), "a line added while following was not delivered"
    finished.add("j")
    s.AddLogLines(tds_pb2.AddLogLinesRequest(lines=_lines("j", 0, "stdout", 1, start=5)))
    t.join(10)
    assert not t.is_alive(), "the follow stream did not end when the job finished"
    assert got == [0, 1, 2, 3, 4, 5]
    channel.close()


def test_follow_with_negative_pos_shows_the_tail_then_only_new_lines(
    tds: Tds, finished: set[str]
) -> None:
    addr, _ = tds
    channel, s = stub(addr)
    s.AddLogLines(tds_pb2.AddLogLinesRequest(lines=_lines("j", 0, "stdout", 5)))
    s.AddLogLines(tds_pb2.AddLogLinesRequest(lines=_lines("j", 0, "stderr", 5)))
    stream = s.GetLogs(tds_pb2.LogsRequest(job_id="j", learner=-1, follow=True, pos=-2))
    got = [(ln.stream, ln.seq) for ln in (next(stream), next(stream))]
    s.AddLogLines(tds_pb2.AddLogLinesRequest(lines=_lines("j", 0, "stdout", 1, start=5)))
    new = next(stream)
    finished.add("j")
    rest = list(stream)
    # The last two lines by (time, learner, stream, seq): both printed at T0+40.
    assert got == [("stderr", 4), ("stdout", 4)]
    assert (new.stream, new.seq) == ("stdout", 5)
    assert rest == []
    channel.close()


def test_follow_fills_a_gap_from_the_store(
    tds: Tds, store: MemoryStore, finished: set[str]
) -> None:
    addr, _ = tds
    channel, s = stub(addr)
    stream = s.GetLogs(tds_pb2.LogsRequest(job_id="j", learner=-1, follow=True))
    time.sleep(0.2)  # let the follower subscribe
    # Written behind the TDS's back (another replica): only the store has seq 0..1.
    store.write_logs(_lines("j", 0, "stdout", 2))
    s.AddLogLines(tds_pb2.AddLogLinesRequest(lines=_lines("j", 0, "stdout", 1, start=2)))
    got = [next(stream).seq for _ in range(3)]
    finished.add("j")
    assert list(stream) == []
    assert got == [0, 1, 2]
    channel.close()


def test_client_cancelling_a_follow_ends_it_quietly(tds: Tds) -> None:
    addr, servicer = tds
    channel, s = stub(addr)
    s.AddLogLines(tds_pb2.AddLogLinesRequest(lines=_lines("j", 0, "stdout", 1)))
    call = s.GetLogs(tds_pb2.LogsRequest(job_id="j", learner=-1, follow=True))
    assert next(call).seq == 0
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    deadline = time.monotonic() + 5
    while servicer.log_broker._subs and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.05)
    assert not servicer.log_broker._subs  # type: ignore[attr-defined]
    channel.close()


def test_metrics_round_trip_with_name_filter_and_follow(tds: Tds, finished: set[str]) -> None:
    addr, _ = tds
    channel, s = stub(addr)
    samples = []
    for i in range(4):
        m = tds_pb2.MetricSample(
            job_id="j",
            learner=0,
            seq=i,
            name="loss" if i % 2 else "acc",
            value=i / 10,
            step=i,
            source="emetrics_file",
        )
        m.time.FromMicroseconds(T0 + i)
        samples.append(m)
    s.AddMetrics(tds_pb2.AddMetricsRequest(samples=samples))
    loss = list(s.GetMetrics(tds_pb2.MetricsRequest(job_id="j", learner=-1, name="loss")))
    assert [(m.step, m.value) for m in loss] == [(1, 0.1), (3, 0.3)]
    finished.add("j")
    followed = list(s.GetMetrics(tds_pb2.MetricsRequest(job_id="j", learner=-1, follow=True)))
    assert [m.seq for m in followed] == [0, 1, 2, 3]
    channel.close()


def test_delete_job_data_waits_for_the_retention(store: MemoryStore) -> None:
    now = [1000.0]
    with tds_in_process(store, retention_s=60, clock=lambda: now[0]) as (addr, servicer):
        channel, s = stub(addr)
        s.AddLogLines(tds_pb2.AddLogLinesRequest(lines=_lines("j", 0, "stdout", 2)))
        s.DeleteJobData(tds_pb2.DeleteJobDataRequest(job_id="j"))
        assert servicer.sweep() == []  # type: ignore[attr-defined]
        assert len(list(s.GetLogs(tds_pb2.LogsRequest(job_id="j", learner=-1)))) == 2
        now[0] += 61
        assert servicer.sweep() == ["j"]  # type: ignore[attr-defined]
        assert list(s.GetLogs(tds_pb2.LogsRequest(job_id="j", learner=-1))) == []
        channel.close()


def test_empty_job_id_is_invalid(tds: Tds) -> None:
    addr, _ = tds
    channel, s = stub(addr)
    with pytest.raises(grpc.RpcError) as err:
        list(s.GetLogs(tds_pb2.LogsRequest(job_id="")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "job_id is empty" in (err.value.details() or "")
    channel.close()


@pytest.mark.parametrize("seconds", [2**63 - 1, -(2**63), 253402300800])
def test_a_since_no_timestamp_can_hold_is_invalid_not_unknown(tds: Tds, seconds: int) -> None:
    """Found by the gRPC fuzzer: an out-of-range `since` raised ValueError in the
    servicer, answered UNKNOWN "Exception iterating responses" (proxied as UNAVAILABLE)."""
    addr, _ = tds
    channel, s = stub(addr)
    for request in (
        tds_pb2.LogsRequest(job_id="j", learner=-1),
        tds_pb2.MetricsRequest(job_id="j", learner=-1),
    ):
        request.since.seconds = seconds
        call = s.GetLogs if isinstance(request, tds_pb2.LogsRequest) else s.GetMetrics
        with pytest.raises(grpc.RpcError) as err:
            list(call(request))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "since" in (err.value.details() or "")
    channel.close()


def test_follow_with_search_delivers_only_matching_new_lines(tds: Tds, finished: set[str]) -> None:
    addr, _ = tds
    channel, s = stub(addr)

    def batch(start: int, n: int) -> tds_pb2.AddLogLinesRequest:
        return tds_pb2.AddLogLinesRequest(
            lines=[
                log_line("j", 0, "stdout", i, f"{'warn' if i % 2 == 0 else 'info'} {i}", T0 + i)
                for i in range(start, start + n)
            ]
        )

    s.AddLogLines(batch(0, 3))
    stream = s.GetLogs(tds_pb2.LogsRequest(job_id="j", learner=-1, follow=True, search="warn"))
    assert [next(stream).seq for _ in range(2)] == [0, 2]
    s.AddLogLines(batch(3, 7))
    got = [next(stream).seq for _ in range(3)]
    finished.add("j")
    assert list(stream) == []
    assert got == [4, 6, 8]
    channel.close()


def test_a_batch_whose_caller_gave_up_waiting_is_not_written(tds: Tds, store: MemoryStore) -> None:
    """Under a backlog a collector's call can wait for a write slot past its deadline; it
    then sends the batch again, so the first copy must not be written too (it doubled the
    search server's work when that server was the bottleneck)."""
    from services.metrics import TDS_WRITES_ABANDONED

    addr, servicer = tds
    abandoned = TDS_WRITES_ABANDONED.labels("log")._value.get()
    channel, s = stub(addr)
    with _refused_behind_a_backlog(servicer, s, "late", timeout=0.5) as error:
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 10  # the handler sees its caller gone and leaves
        while servicer.write_gate.waiting() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert servicer.write_gate.waiting() == 0
    time.sleep(0.3)  # a handler still waiting would write now that the slots are free
    assert list(s.GetLogs(tds_pb2.LogsRequest(job_id="late", learner=-1))) == []
    assert TDS_WRITES_ABANDONED.labels("log")._value.get() == abandoned + 1
    channel.close()


def test_a_batch_that_waits_too_long_for_a_slot_is_refused_busy_not_written(
    tds: Tds, store: MemoryStore
) -> None:
    """Back-pressure: behind a backlog a write is answered RESOURCE_EXHAUSTED (the collector
    retries it after a backoff) well before the caller's deadline, and nothing is written,
    so the batch is never written for a caller about to give up on it."""
    addr, servicer = tds
    servicer.max_write_wait_s = 0.2
    channel, s = stub(addr)
    with _refused_behind_a_backlog(servicer, s, "busy", timeout=60) as error:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "behind" in (error.details() or "")
        assert servicer.write_gate.waiting() == 0
    assert list(s.GetLogs(tds_pb2.LogsRequest(job_id="busy", learner=-1))) == []
    s.AddLogLines(tds_pb2.AddLogLinesRequest(lines=_lines("busy", 0, "stdout", 3)), timeout=60)
    assert len(list(s.GetLogs(tds_pb2.LogsRequest(job_id="busy", learner=-1)))) == 3
    channel.close()


def test_a_collector_waits_for_a_write_longer_than_the_tds_can_take_to_answer_it() -> None:
    """A collector that gave up on a write the search server was still doing sent the batch
    again, and the server wrote it twice just when it was behind. The TDS answers a write
    within its longest wait for a slot plus the search client's timeout; a collector's
    deadline for a write is longer than both."""
    import inspect

    from learner.controller.collector import Collector
    from services.tds.es_store import ElasticsearchStore

    def default(fn: object, name: str) -> float:
        return float(inspect.signature(fn).parameters[name].default)  # type: ignore[arg-type]

    tds_answers_within = default(TrainingDataServicer, "max_write_wait_s") + default(
        ElasticsearchStore, "request_timeout_s"
    )
    assert default(Collector, "write_timeout_s") > tds_answers_within
