"""API errors: one typed exception per client-visible failure, mapped to gRPC and HTTP codes."""

from __future__ import annotations

import math

import grpc


class ApiError(Exception):
    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    http_status: int = 500
    code: str = "internal"
    # Set when retrying later may succeed: sent as HTTP Retry-After and as gRPC trailing
    # metadata `retry-after-ms`, so clients back off by what the server said.
    retry_after_s: float | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def http_headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def grpc_trailers(self) -> tuple[tuple[str, str], ...]:
        if self.retry_after_s is None:
            return ()
        return (("retry-after-ms", str(int(self.retry_after_s * 1000))),)


class BadRequest(ApiError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400
    code = "bad_request"


class Unauthenticated(ApiError):
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401
    code = "unauthenticated"


class PermissionDenied(ApiError):
    grpc_code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403
    code = "permission_denied"


class NotFound(ApiError):
    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404
    code = "not_found"


class Conflict(ApiError):
    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 409
    code = "conflict"


class Unimplemented(ApiError):
    grpc_code = grpc.StatusCode.UNIMPLEMENTED
    http_status = 501
    code = "unimplemented"


class TooLarge(ApiError):
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 413
    code = "too_large"


class Unavailable(ApiError):
    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    code = "unavailable"


class Overloaded(ApiError):
    """Shed before anything was stored; the caller may retry after ``retry_after_s``."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429
    code = "overloaded"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
