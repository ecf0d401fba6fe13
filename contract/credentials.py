"""How a caller attaches its credential to every gRPC call on a channel.

Both sides use it: the platform's processes send their service credential to each
other's internal ports, and a learner's log collector sends its job token to the training
data service (the token travels in the learner spec, `LearnerSpec.tds_token`). The value
is `Bearer <token>` under the `authorization` key, as on the public API."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import grpc

AUTHORIZATION_METADATA = "authorization"


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


class _Details(_CallDetails, grpc.ClientCallDetails):  # type: ignore[misc]
    pass


class BearerInterceptor(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """Adds `authorization: Bearer <token>` to every call (replacing one already set)."""

    def __init__(self, token: str) -> None:
        self._value = f"Bearer {token}"

    def _details(self, details: grpc.ClientCallDetails) -> _Details:
        metadata = [(k, v) for k, v in (details.metadata or ()) if k != AUTHORIZATION_METADATA]
        metadata.append((AUTHORIZATION_METADATA, self._value))
        return _Details(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(
        self, continuation: Callable[..., Any], details: Any, requests: Any
    ) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(
        self, continuation: Callable[..., Any], details: Any, requests: Any
    ) -> Any:
        return continuation(self._details(details), requests)


def with_bearer(channel: grpc.Channel, token: str) -> grpc.Channel:
    """`channel` with `token` on every call; `channel` itself when there is no token."""
    if not token:
        return channel
    return grpc.intercept_channel(channel, BearerInterceptor(token))
