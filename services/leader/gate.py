"""The standby's gate: the services only the active daemon may answer refuse with
UNAVAILABLE while this daemon waits as a hot standby, so a client that lists both
daemons (`--api A,B`) moves on to the next address, and a call never reaches a service
whose state the active daemon owns. Health, reflection and the training data service
(stateless over Elasticsearch) answer on a standby too."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import grpc

GATED_PREFIXES = (
    "/rhizome.v1.Trainer/",
    "/rhizome.v1.LifecycleManager/",
    "/rhizome.v1.Scheduler/",
)
STANDBY_MESSAGE = (
    "this Rhizome daemon is a hot standby and does not serve until the active daemon "
    "dies; call the active daemon (the SDK and CLI try every address of --api A,B in turn)"
)


def _refuse_unary(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAVAILABLE, STANDBY_MESSAGE)


def _refuse_stream(requests: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAVAILABLE, STANDBY_MESSAGE)


class StandbyGate(grpc.ServerInterceptor):
    def __init__(self, leading: threading.Event) -> None:
        self.leading = leading

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if (
            handler is None
            or self.leading.is_set()
            or not handler_call_details.method.startswith(GATED_PREFIXES)
        ):
            return handler
        kind = (
            grpc.unary_unary_rpc_method_handler
            if handler.unary_unary
            else grpc.unary_stream_rpc_method_handler
            if handler.unary_stream
            else grpc.stream_unary_rpc_method_handler
            if handler.stream_unary
            else grpc.stream_stream_rpc_method_handler
        )
        refuse = _refuse_unary if handler.unary_unary or handler.unary_stream else _refuse_stream
        return kind(refuse, handler.request_deserializer, handler.response_serializer)


def rest_gate(app: Any, leading: threading.Event) -> Any:
    """The same gate for the REST gateway (an ASGI app): 503 with a retry-after and the
    API's `{code, message}` error body while this daemon is a standby."""
    body = json.dumps({"code": "UNAVAILABLE", "message": STANDBY_MESSAGE}).encode()
    headers = [(b"content-type", b"application/json"), (b"retry-after", b"1")]

    async def gated(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") == "http" and not leading.is_set():
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await app(scope, receive, send)

    return gated
