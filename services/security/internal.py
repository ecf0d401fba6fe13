"""The internal port's credentials: one per-daemon shared secret, and job tokens derived
from it.

- The **service credential** is `rz_svc_` + 32 random bytes, generated on first start into
  `<data dir>/internal.secret` (0600, `--internal-secret-file`). Daemons that host
  services for each other share the file; nothing else needs it.
- A **job token** is `rz_job_<HMAC-SHA256(secret, job id)>.<job id>`: the LCM issues it
  to a job's guardian at deploy, the guardian puts it in each learner's spec, and the
  learner's collector sends it to the training data service. Deriving it from the secret
  means any daemon holding the secret can check it with one HMAC and no store lookup,
  and nothing per job has to be stored or cleaned up. It never expires; a job id is never
  reused, and rotating the secret (delete the file, restart) revokes every job token.

`InternalAuthInterceptor` guards the internal gRPC server: no credential or a wrong one is
UNAUTHENTICATED; a job token on anything but the data service's append and read methods
is PERMISSION_DENIED. The data service itself confines a job token to its own job
(services/tds/servicer.py), because only it sees which job a request is about.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from services.security.api import (
    HOW_TO_AUTHENTICATE,
    Caller,
    CredentialError,
    ServiceCredentials,
)

log = logging.getLogger("rhizome.security")

SECRET_FILE = "internal.secret"
SERVICE_PREFIX = "rz_svc_"
JOB_PREFIX = "rz_job_"
# What a job token may call: append its learners' logs and metrics, read them back (the
# collector checks what the service stored). Deleting, or anything of the LCM or the
# scheduler, needs the service credential.
JOB_METHODS = frozenset(
    f"/rhizome.v1.TrainingData/{m}"
    for m in ("AddLogLines", "AddMetrics", "GetLogs", "GetMetrics", "CountStored")
)
# Answered without a credential on the internal port: says only whether it is up.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


class SharedSecretCredentials(ServiceCredentials):
    def __init__(self, secret: str) -> None:
        if not secret.startswith(SERVICE_PREFIX) or len(secret) < len(SERVICE_PREFIX) + 32:
            raise CredentialError(
                f"the service secret is not an {SERVICE_PREFIX}... secret; delete the file "
                "and restart the daemon to generate a new one"
            )
        self._secret = secret
        self._key = secret.encode()

    @classmethod
    def from_file(cls, path: Path, create: bool = True) -> SharedSecretCredentials:
        """The secret in `path`; generated there (0600) when missing and `create`."""
        from services.api.auth import write_secret_file

        path = Path(path)
        if not path.exists():
            if not create:
                raise CredentialError(f"no service secret at {path}: {HOW_TO_AUTHENTICATE}")
            write_secret_file(path, SERVICE_PREFIX + secrets.token_urlsafe(32))
            log.info("generated the internal service secret in %s (mode 0600)", path)
        if path.stat().st_mode & 0o077:
            raise CredentialError(
                f"{path} is readable by other users; `chmod 600 {path}` (or delete it and "
                "restart to generate a new secret)"
            )
        return cls(path.read_text().strip())

    def service_token(self) -> str:
        return self._secret

    def _mac(self, job_id: str) -> str:
        digest = hmac.new(self._key, f"job:{job_id}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def job_token(self, job_id: str) -> str:
        if not job_id:
            raise ValueError("a job token needs a job id")
        return f"{JOB_PREFIX}{self._mac(job_id)}.{job_id}"

    def identify(self, token: str) -> Caller:
        if token.startswith(SERVICE_PREFIX):
            if hmac.compare_digest(token.encode(), self._key):
                return Caller()
            raise CredentialError(f"wrong service credential: {HOW_TO_AUTHENTICATE}")
        if token.startswith(JOB_PREFIX):
            mac, dot, job_id = token[len(JOB_PREFIX) :].partition(".")
            if dot and job_id and hmac.compare_digest(mac, self._mac(job_id)):
                return Caller(job_id)
            raise CredentialError(f"invalid job token: {HOW_TO_AUTHENTICATE}")
        raise CredentialError(f"no service credential: {HOW_TO_AUTHENTICATE}")


def job_scope(credentials: ServiceCredentials | None, context: grpc.ServicerContext) -> str:
    """The job a call is confined to: its job token's job, or "" for the platform itself
    (the service credential, an in-process call, or a server with no credentials set up).
    The internal server's interceptor has refused wrong credentials before this runs."""
    if credentials is None:
        return ""
    try:
        return credentials.caller(context.invocation_metadata()).job_id
    except CredentialError:
        return ""  # in-process calls carry no metadata; remote ones were checked


def _refusal(
    handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, details: str
) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses without reading the request."""

    def refuse(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, details)

    serializer = handler.response_serializer if handler is not None else None
    if handler is not None and handler.request_streaming:
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse, None, serializer)
        return grpc.stream_unary_rpc_method_handler(refuse, None, serializer)
    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, None, serializer)
    return grpc.unary_unary_rpc_method_handler(refuse, None, serializer)


class InternalAuthInterceptor(grpc.ServerInterceptor):
    """Every call to the internal port carries the service credential or a job token."""

    def __init__(self, credentials: ServiceCredentials) -> None:
        self.credentials = credentials

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method in OPEN_METHODS:
            return continuation(handler_call_details)
        try:
            caller = self.credentials.caller(handler_call_details.invocation_metadata)
        except CredentialError as exc:
            return _refusal(
                continuation(handler_call_details), grpc.StatusCode.UNAUTHENTICATED, str(exc)
            )
        if not caller.is_service and method not in JOB_METHODS:
            return _refusal(
                continuation(handler_call_details),
                grpc.StatusCode.PERMISSION_DENIED,
                f"a job token may only append to and read its own job's logs and metrics, "
                f"not call {method}",
            )
        return continuation(handler_call_details)
