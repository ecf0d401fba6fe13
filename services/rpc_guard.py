"""A request that is not a valid message is the caller's mistake, not the server's.

grpc's server parses a request before any servicer code runs; when the bytes are not a
valid message (truncated, a length past the end, invalid UTF-8 in a string field...) it
answers INTERNAL "Exception deserializing request!" and logs the parser's traceback at
ERROR, once per request: a client error reported as a server fault, and a log any
client can flood. `MalformedRequestInterceptor` wraps every method's deserializer so a
parse failure becomes INVALID_ARGUMENT naming the message type expected, with no
traceback anywhere. Install it on every server (after the metrics interceptor, so the
refusal is counted under its real code)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

log = logging.getLogger("rhizome.rpc")


class _Malformed:
    """Stands in for a request that could not be parsed."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _lenient(deserializer: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, and whatever else a parser may raise
            log.debug("malformed request to %s: %s", method, exc)
            return _Malformed(str(exc) or type(exc).__name__)

    return deserialize


def _refuse(context: grpc.ServicerContext, method: str, reason: str) -> None:
    context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the request to {method} is not a valid message: {reason[:300]}",
    )


def _guard_unary(fn: Callable[[Any, grpc.ServicerContext], Any], method: str) -> Any:
    def call(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            _refuse(context, method, request.reason)
        return fn(request, context)

    return call


def _guard_stream_in(fn: Callable[[Any, grpc.ServicerContext], Any], method: str) -> Any:
    def call(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        def checked() -> Iterator[Any]:
            for request in requests:
                if isinstance(request, _Malformed):
                    _refuse(context, method, request.reason)
                yield request

        return fn(checked(), context)

    return call


class MalformedRequestInterceptor(grpc.ServerInterceptor):
    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        deserializer = _lenient(handler.request_deserializer, method)
        serializer = handler.response_serializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _guard_unary(handler.unary_unary, method), deserializer, serializer
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _guard_unary(handler.unary_stream, method), deserializer, serializer
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _guard_stream_in(handler.stream_unary, method), deserializer, serializer
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _guard_stream_in(handler.stream_stream, method), deserializer, serializer
            )
        return handler
