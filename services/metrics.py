"""Prometheus metrics shared by every Rhizome service: one registry, one way to serve it.

Every service process (or the monolithic daemon) does two things:

    server = grpc.server(pool, interceptors=[metrics.GrpcMetricsInterceptor()])
    metrics.serve_metrics(port)           # GET http://127.0.0.1:PORT/metrics

and the services that own the facts update the gauges declared here:
`JOBS_BY_STATE.labels(state="QUEUED").set(n)` (lcm/api), `QUEUE_LENGTH.labels(queue=...)`
(scheduler), `GUARDIAN_RESTARTS.inc()` (lcm). Declaring them in one module keeps the
metric names and labels consistent across processes; prometheus_client does the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.exposition import generate_latest

REGISTRY = CollectorRegistry(auto_describe=True)

GRPC_REQUESTS = Counter(
    "rhizome_grpc_requests_total",
    "gRPC requests handled, by service, method and status code.",
    ["service", "method", "code"],
    registry=REGISTRY,
)
GRPC_LATENCY = Histogram(
    "rhizome_grpc_request_duration_seconds",
    "Time from a gRPC request's arrival to its last response message.",
    ["service", "method"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    registry=REGISTRY,
)
JOBS_BY_STATE = Gauge("rhizome_jobs", "Jobs by lifecycle state.", ["state"], registry=REGISTRY)
QUEUE_LENGTH = Gauge(
    "rhizome_queue_length", "Jobs waiting to be scheduled, by queue.", ["queue"], registry=REGISTRY
)
GUARDIAN_RESTARTS = Counter(
    "rhizome_guardian_restarts_total",
    "Guardians restarted after a crash or a lost lease.",
    registry=REGISTRY,
)
SUPERVISED_RESTARTS = Counter(
    "rhizome_supervised_restarts_total",
    "Platform processes (daemon, etcd, MongoDB-wire, Elasticsearch-API) the supervisor of "
    "`rhizome up` restarted after they died.",
    ["process"],
    registry=REGISTRY,
)
STORE_UP = Gauge(
    "rhizome_store_up",
    "1 while the daemon's client of a store (mongodb, etcd) answers its health probe, else 0.",
    ["store"],
    registry=REGISTRY,
)
TDS_DOCUMENTS = Counter(
    "rhizome_tds_documents_written_total",
    "Log lines and metric samples the training data service indexed.",
    ["kind"],
    registry=REGISTRY,
)
TDS_WRITES_ABANDONED = Counter(
    "rhizome_tds_writes_abandoned_total",
    "Batches not written because their caller gave up while waiting for the search server "
    "(it sends them again): a sign the store cannot keep up.",
    ["kind"],
    registry=REGISTRY,
)
TDS_FOLLOWERS = Gauge(
    "rhizome_tds_follow_streams", "Open follow streams.", ["kind"], registry=REGISTRY
)


def _split(method: str) -> tuple[str, str]:
    # "/rhizome.v1.TrainingData/GetLogs" -> ("rhizome.v1.TrainingData", "GetLogs")
    _, service, name = [*method.split("/"), "", ""][:3]
    return service or "unknown", name or method


def _code_of(context: grpc.ServicerContext, exc: BaseException | None) -> str:
    # context.code() is what the servicer set (set_code or abort); unset means OK,
    # unless an exception escaped, which grpc turns into UNKNOWN.
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, grpc.StatusCode):
        return code.name
    return "UNKNOWN" if exc is not None and not isinstance(exc, GeneratorExit) else "OK"


class _MethodMetrics:
    """One method's labelled series, looked up once: `labels()` per call (validation, a
    lock, a dict look-up, twice a call) was most of the interceptor's cost, ~3 % of the
    daemon's GIL time on the submit path (issue #18)."""

    def __init__(self, full_method: str) -> None:
        self.service, self.method = _split(full_method)
        self.latency = GRPC_LATENCY.labels(self.service, self.method)
        self.requests: dict[str, Any] = {}  # status code -> its counter

    def record(
        self, context: grpc.ServicerContext, start: float, exc: BaseException | None
    ) -> None:
        code = _code_of(context, exc)
        counter = self.requests.get(code)
        if counter is None:
            counter = self.requests[code] = GRPC_REQUESTS.labels(self.service, self.method, code)
        counter.inc()
        self.latency.observe(time.perf_counter() - start)


class GrpcMetricsInterceptor(grpc.ServerInterceptor):
    """Counts every request by final status code and times it (streams: until the last
    message is sent, or the client goes away)."""

    def __init__(self) -> None:
        # method -> its series; only methods a handler serves get here (an unknown
        # method's handler is None), so the map stays as small as the services.
        self._methods: dict[str, _MethodMetrics] = {}

    def _metrics(self, method: str) -> _MethodMetrics:
        found = self._methods.get(method)
        if found is None:  # two threads may both make it: the same series either way
            found = self._methods[method] = _MethodMetrics(method)
        return found

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        record = self._metrics(handler_call_details.method).record

        def wrap_unary(fn: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Any]:
            def call(request: Any, context: grpc.ServicerContext) -> Any:
                start = time.perf_counter()
                exc: BaseException | None = None
                try:
                    return fn(request, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    record(context, start, exc)

            return call

        def wrap_stream(
            fn: Callable[[Any, grpc.ServicerContext], Iterator[Any]],
        ) -> Callable[..., Iterator[Any]]:
            def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                start = time.perf_counter()
                exc: BaseException | None = None
                try:
                    yield from fn(request, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    record(context, start, exc)

            return call

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                wrap_unary(handler.unary_unary),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                wrap_stream(handler.unary_stream),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                wrap_unary(handler.stream_unary),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                wrap_stream(handler.stream_stream),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return handler


class MetricsHTTPServer:
    """The `/metrics` endpoint; `stop()` closes the socket (tests and daemon shutdown)."""

    def __init__(self, server: Any, thread: Any) -> None:
        self._server = server
        self._thread = thread
        self.port = int(server.server_address[1])

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(port: int = 0, host: str = "127.0.0.1") -> MetricsHTTPServer:
    """Serve REGISTRY at http://HOST:PORT/metrics in a daemon thread (port 0: any free)."""
    server, thread = start_http_server(port, addr=host, registry=REGISTRY)
    return MetricsHTTPServer(server, thread)


def render() -> bytes:
    """The current exposition text (what /metrics answers)."""
    return generate_latest(REGISTRY)
