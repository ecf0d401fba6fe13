"""API errors: one typed exception per client-visible failure, mapped to gRPC and HTTP codes."""

from __future__ import annotations

import math

import grpc

# What a client sees of an error: its gRPC status, its HTTP status and the `code` of the
# REST error body.
Status = tuple[grpc.StatusCode, int, str]


class ApiError(Exception):
    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    http_status: int = 500
    code: str = "internal"
    # Set when retrying later may succeed: sent as HTTP Retry-After and as gRPC trailing
    # metadata `retry-after-ms`, so clients back off by what the server said.
    retry_after_s: float | None = None

    def __init_subclass__(cls, *, status: Status | None = None) -> None:
        """Each kind of error names its `status` where it is declared."""
        super().__init_subclass__()
        if status is not None:
            cls.grpc_code, cls.http_status, cls.code = status

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


class BadRequest(ApiError, status=(grpc.StatusCode.INVALID_ARGUMENT, 400, "bad_request")):
    """The request itself is wrong (a bad manifest, a field out of bounds)."""


class Unauthenticated(ApiError, status=(grpc.StatusCode.UNAUTHENTICATED, 401, "unauthenticated")):
    """No credential, or one nobody issued."""


class PermissionDenied(
    ApiError, status=(grpc.StatusCode.PERMISSION_DENIED, 403, "permission_denied")
):
    """A known caller asking for what is not theirs."""


class NotFound(ApiError, status=(grpc.StatusCode.NOT_FOUND, 404, "not_found")):
    """What the request names does not exist (or is not the caller's)."""


class Conflict(ApiError, status=(grpc.StatusCode.FAILED_PRECONDITION, 409, "conflict")):
    """Not in this state (halting a job that ended), or an idempotency key reused."""


class Unimplemented(ApiError, status=(grpc.StatusCode.UNIMPLEMENTED, 501, "unimplemented")):
    """What this daemon does not offer."""


class TooLarge(ApiError, status=(grpc.StatusCode.RESOURCE_EXHAUSTED, 413, "too_large")):
    """A manifest, code archive or request over its limit."""


class Unavailable(ApiError, status=(grpc.StatusCode.UNAVAILABLE, 503, "unavailable")):
    """A store or service the request needs does not answer."""


class Overloaded(ApiError, status=(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "overloaded")):
    """Shed before anything was stored; the caller may retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
