"""API errors: one typed exception per client-visible failure, mapped to gRPC and HTTP codes."""

from __future__ import annotations

import grpc


class ApiError(Exception):
    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    http_status: int = 500
    code: str = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


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
