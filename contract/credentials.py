"""How a caller attaches its credential to every gRPC call on a channel.

Both sides use it: the platform's processes send their service credential to each
other's internal ports, and a learner's log collector sends its job token to the training
data service (the token travels in the learner spec, `LearnerSpec.tds_token`). The value
is `Bearer <token>` under the `authorization` key, as on the public API.

Also the one way to print a store URI: `redact_uri` (platform and learners alike, since
both print etcd, MongoDB, Elasticsearch and object-store addresses in errors and logs)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import grpc

AUTHORIZATION_METADATA = "authorization"

# The name an internal port's certificate is checked against, whatever address reaches it
# (a peer's IP, a container's gateway): the platform's private CA signs only this
# platform's certificates (all valid for `localhost`), so the CA, not the address, is what
# identifies the server.
INTERNAL_SERVER_NAME = "localhost"

# `scheme://user:PASSWORD@host`: the password of a URI's userinfo (MongoDB, etcd, ES
# URIs all take one). `[^\s/@:]*` stops the user at the first colon; the password runs to
# the last `@` before the host, since an unescaped `@` in a password is still a password.
_URI_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^\s/@:]*:)[^\s/]*@")
# Query parameters that carry a secret (`?password=`, S3 presigned `X-Amz-Signature=`,
# `secret_key=`, `token=`...), whatever the URI's scheme.
_SECRET_PARAM = re.compile(
    r"(?i)([?&;](?:[a-z0-9_.-]*(?:password|passwd|secret|token|signature|credential|"
    r"access_?key)[a-z0-9_.-]*)=)[^&;\s#'\"]*"
)
REDACTED = "***"
# A learner's renewed TDS client certificate (`{ca, cert, key}` JSON, 0600) in its learner
# directory: the guardian writes the next one before the last expires (job certificates
# are short-lived); the log collector prefers it to its spec's `tds_tls` and re-reads it.
TDS_TLS_FILE = "tds-tls.json"
# Where the backend hands it instead, when it cannot write into the learner directory: a
# directory holding `tds-tls.json` (Kubernetes: the job's TLS Secret, mounted as a
# directory, which the kubelet refreshes in the running pod). One lookup, `tds_tls_file`.
TDS_TLS_DIR_ENV = "RHIZOME_TDS_TLS_DIR"


def tds_tls_file(learner_dir: Path, environ: Mapping[str, str] | None = None) -> Path:
    """The renewed TDS certificate a learner's log collector re-reads: under
    `$RHIZOME_TDS_TLS_DIR` when the backend sets it, else in the learner directory."""
    where = (os.environ if environ is None else environ).get(TDS_TLS_DIR_ENV, "")
    return Path(where or learner_dir) / TDS_TLS_FILE


def redact_uri(text: str) -> str:
    """`text` with every URI's password and secret-bearing query parameters replaced by
    `***`: `mongodb://rz:hunter2@db:27017/x?authSource=admin` becomes
    `mongodb://rz:***@db:27017/x?authSource=admin`. Safe on any text (an error message, a
    log line, a whole command line); what is not a URI passes unchanged."""
    text = _URI_PASSWORD.sub(lambda m: m.group(1) + REDACTED + "@", text)
    return _SECRET_PARAM.sub(lambda m: m.group(1) + REDACTED, text)


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


def tls_from_json(raw: str, variable: str, writer: str = "") -> dict[str, str]:
    """A TLS client certificate as the platform passes it in an environment variable:
    JSON `{ca, cert, key}`; {} when `raw` is empty (a plaintext platform). ValueError
    naming `variable` (and who writes it) when malformed."""
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        raise ValueError(f"${variable} is not JSON{writer}") from None
    if not isinstance(value, dict) or not all(
        isinstance(value.get(k), str) for k in ("ca", "cert", "key")
    ):
        raise ValueError(f"${variable} must be a JSON object with ca, cert and key")
    return {k: value[k] for k in ("ca", "cert", "key")}


def tls_channel_credentials(tls: Mapping[str, str]) -> grpc.ChannelCredentials:
    """Mutual-TLS credentials from PEM text `{ca, cert, key}` (a learner's
    `LearnerSpec.tds_tls`): trust `ca` for the server, present `cert`."""
    missing = [k for k in ("ca", "cert", "key") if not tls.get(k)]
    if missing:
        raise ValueError(f"TLS credentials lack {', '.join(missing)} (PEM text expected)")
    return grpc.ssl_channel_credentials(
        root_certificates=tls["ca"].encode(),
        private_key=tls["key"].encode(),
        certificate_chain=tls["cert"].encode(),
    )


def internal_channel(
    address: str,
    credentials: grpc.ChannelCredentials | None = None,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A channel to an internal port: mutual TLS with `credentials` (checked against the
    platform CA's `INTERNAL_SERVER_NAME`), plaintext without."""
    if credentials is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(
        address,
        credentials,
        options=[*options, ("grpc.ssl_target_name_override", INTERNAL_SERVER_NAME)],
    )
