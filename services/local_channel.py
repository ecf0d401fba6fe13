"""An in-process stand-in for a gRPC channel to services hosted by the same daemon.

Services talk only through the RPCs in protos/, even when one daemon hosts several of
them. Python's gRPC has no in-process transport, and a loopback call costs a few
milliseconds of CPU under the GIL (HTTP/2 framing, serialization, thread hand-offs):
with the scheduler co-hosted, two such calls per submit halved submit throughput. This
channel hands the request message straight to the servicer's handler: same stubs, same
messages, same status codes, no wire. Unary-unary methods only; streams and methods of
services hosted elsewhere go over a real channel. Server interceptors are not run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc


class LocalRpcError(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    """What a local call raises where a real channel would raise grpc.RpcError."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def initial_metadata(self) -> Any:
        return ()

    def trailing_metadata(self) -> Any:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False


class _Aborted(Exception):
    pass


class _LocalContext:
    """The part of grpc.ServicerContext the servicers use."""

    def __init__(self, metadata: Any) -> None:
        self._metadata = tuple(metadata or ())
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def invocation_metadata(self) -> Any:
        return self._metadata

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise _Aborted(details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def is_active(self) -> bool:
        return True

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None


class _LocalUnaryUnary:
    """A unary-unary callable; the handler is looked up at call time, because stubs are
    made while the daemon is still registering its services."""

    def __init__(self, channel: LocalChannel, method: str, args: Any, kwargs: Any) -> None:
        self._channel = channel
        self._method = method
        self._args = args
        self._kwargs = kwargs
        self._remote: Any = None

    def _behaviour(self) -> Callable[[Any, Any], Any] | None:
        handler = self._channel.handlers.get(self._method)
        return handler.unary_unary if handler is not None else None

    def _real(self) -> Any:
        if self._remote is None:
            self._remote = self._channel.fallback.unary_unary(
                self._method, *self._args, **self._kwargs
            )
        return self._remote

    def __call__(
        self, request: Any, timeout: float | None = None, metadata: Any = None, **kw: Any
    ) -> Any:
        behaviour = self._behaviour()
        if behaviour is None:
            return self._real()(request, timeout=timeout, metadata=metadata, **kw)
        context = _LocalContext(metadata)
        try:
            response = behaviour(request, context)
        except _Aborted:
            raise LocalRpcError(context.code or grpc.StatusCode.UNKNOWN, context.details) from None
        except LocalRpcError:
            raise
        except Exception as exc:  # a real server answers UNKNOWN for an unhandled error
            raise LocalRpcError(grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}") from exc
        if context.code not in (None, grpc.StatusCode.OK):
            raise LocalRpcError(context.code, context.details)
        return response

    def with_call(self, request: Any, **kwargs: Any) -> Any:
        return self(request, **kwargs), None

    def future(
        self, request: Any, timeout: float | None = None, metadata: Any = None, **_: Any
    ) -> Any:
        if self._behaviour() is None:
            return self._real().future(request, timeout=timeout, metadata=metadata)
        return self._channel.pool.submit(self, request, timeout, metadata)


class LocalChannel:
    """Dispatches unary calls to handlers registered in this process; anything else goes
    to `fallback` (a real channel to the same server)."""

    def __init__(self, handlers: dict[str, grpc.RpcMethodHandler], fallback: grpc.Channel) -> None:
        self.handlers = handlers  # filled in while the daemon registers its services
        self.fallback = fallback
        self.pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="local-rpc")

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _LocalUnaryUnary(self, method, args, kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.fallback.unary_stream(method, *args, **kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.fallback.stream_unary(method, *args, **kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.fallback.stream_stream(method, *args, **kwargs)

    def subscribe(self, callback: Any, try_to_connect: bool = False) -> None:
        self.fallback.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback: Any) -> None:
        self.fallback.unsubscribe(callback)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.fallback.close()


class RecordingServer:
    """Wraps the daemon's grpc.Server and remembers every method handler registered on
    it, so LocalChannel can find them."""

    def __init__(self, server: grpc.Server) -> None:
        self._server = server
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}
        self._lock = threading.Lock()

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        with self._lock:
            for name, handler in handlers.items():
                self.handlers[f"/{service}/{name}"] = handler
        self._server.add_registered_method_handlers(service, handlers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)
