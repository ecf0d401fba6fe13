"""LocalChannel: the generated stubs work unchanged, status codes survive, unknown
methods fall back to the real channel."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from rhizome.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.local_channel import LocalChannel, RecordingServer


class Servicer(scheduler_pb2_grpc.SchedulerServicer):
    def Explain(self, request: Any, context: Any) -> Any:
        if request.job_id == "missing":
            context.abort(grpc.StatusCode.NOT_FOUND, "no job 'missing'")
        return scheduler_pb2.ExplainResponse(explanation=f"why {request.job_id}")

    def Release(self, request: Any, context: Any) -> Any:
        raise ValueError("boom")


class FakeServer:
    def __init__(self) -> None:
        self.generic: list[Any] = []
        self.registered: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: Any) -> None:
        self.registered[service] = handlers


class FallbackChannel:
    def __init__(self) -> None:
        self.asked: list[str] = []

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.asked.append(method)
        return lambda request, **kw: scheduler_pb2.ClusterView(queued_jobs=7)

    def close(self) -> None:
        pass


def make() -> tuple[scheduler_pb2_grpc.SchedulerStub, FallbackChannel, FakeServer]:
    fake = FakeServer()
    server = RecordingServer(fake)  # type: ignore[arg-type]
    fallback = FallbackChannel()
    # The stub is made before the servicer registers, as in the daemon.
    stub = scheduler_pb2_grpc.SchedulerStub(LocalChannel(server.handlers, fallback))  # type: ignore[arg-type]
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(Servicer(), server)  # type: ignore[arg-type]
    return stub, fallback, fake


def test_a_local_call_reaches_the_servicer_and_the_real_server_still_gets_it() -> None:
    stub, fallback, fake = make()
    assert stub.Explain(scheduler_pb2.ExplainRequest(job_id="j1")).explanation == "why j1"
    assert fallback.asked == []
    assert "rhizome.v1.Scheduler" in fake.registered and fake.generic


def test_abort_becomes_an_rpc_error_with_its_code() -> None:
    stub, _, _ = make()
    with pytest.raises(grpc.RpcError) as info:
        stub.Explain(scheduler_pb2.ExplainRequest(job_id="missing"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "no job 'missing'"


def test_an_unhandled_error_is_unknown_and_a_future_reports_it() -> None:
    stub, _, _ = make()
    future = stub.Release.future(scheduler_pb2.ReleaseRequest(job_id="x"))
    with pytest.raises(grpc.RpcError) as info:
        future.result(timeout=5)
    assert info.value.code() == grpc.StatusCode.UNKNOWN
    assert "ValueError: boom" in info.value.details()


def test_a_method_nobody_registered_goes_to_the_real_channel() -> None:
    fallback = FallbackChannel()
    stub = scheduler_pb2_grpc.SchedulerStub(LocalChannel({}, fallback))  # type: ignore[arg-type]
    assert stub.GetCluster(scheduler_pb2.GetClusterRequest()).queued_jobs == 7
    assert fallback.asked == ["/rhizome.v1.Scheduler/GetCluster"]
