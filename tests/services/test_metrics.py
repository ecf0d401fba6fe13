"""The shared Prometheus helper: gRPC request counts/latency and the /metrics endpoint."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from rhizome.v1 import tds_pb2

from services import metrics
from services.tds.memory_store import MemoryStore
from tests.services.tds.helpers import stub, tds_in_process


def _value(name: str, labels: dict[str, str]) -> float:
    v = metrics.REGISTRY.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_requests_are_counted_by_code_and_timed_and_served_on_metrics() -> None:
    ok = {"service": "rhizome.v1.TrainingData", "method": "AddLogLines", "code": "OK"}
    bad = {**ok, "code": "INVALID_ARGUMENT"}
    before_ok, before_bad = (
        _value("rhizome_grpc_requests_total", ok),
        _value("rhizome_grpc_requests_total", bad),
    )
    timed = {"service": "rhizome.v1.TrainingData", "method": "GetLogs"}
    before_timed = _value("rhizome_grpc_request_duration_seconds_count", timed)
    with tds_in_process(MemoryStore()) as (addr, _):
        channel, s = stub(addr)
        line = tds_pb2.LogLine(job_id="j", stream="stdout", line="x")
        s.AddLogLines(tds_pb2.AddLogLinesRequest(lines=[line]))
        with pytest.raises(grpc.RpcError):
            s.AddLogLines(tds_pb2.AddLogLinesRequest(lines=[tds_pb2.LogLine(stream="bogus")]))
        assert len(list(s.GetLogs(tds_pb2.LogsRequest(job_id="j", learner=-1)))) == 1
        channel.close()
    assert _value("rhizome_grpc_requests_total", ok) == before_ok + 1
    assert _value("rhizome_grpc_requests_total", bad) == before_bad + 1
    assert _value("rhizome_grpc_request_duration_seconds_count", timed) == before_timed + 1

    metrics.JOBS_BY_STATE.labels(state="QUEUED").set(3)
    metrics.QUEUE_LENGTH.labels(queue="default").set(2)
    metrics.GUARDIAN_RESTARTS.inc()
    server = metrics.serve_metrics(0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        server.stop()
    assert 'rhizome_jobs{state="QUEUED"} 3.0' in text
    assert 'rhizome_queue_length{queue="default"} 2.0' in text
    assert "rhizome_guardian_restarts_total" in text
    assert 'rhizome_tds_documents_written_total{kind="log"}' in text
