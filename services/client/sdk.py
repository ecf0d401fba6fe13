"""The Python SDK: a client of the public Trainer API only (gRPC).

from services.client.sdk import Client
with Client("127.0.0.1:50051", token="rz_...") as rz:
    job = rz.create_job(open("manifest.yml").read(), code_zip=zip_dir("src/"))
    print(rz.get_job(job.job_id).status)

The token is, in order: the `token=` argument, $RHIZOME_TOKEN, and — when `address` is
the embedded platform's (its `platform.json` in the data directory says so) — the
platform's `<data dir>/admin.token`. Without a token the SDK sends the `user` id as
`x-rhizome-user`, which only a daemon run with --insecure-trust-user-header believes.

TLS, in order: `tls=False` is plaintext; a CA file (`ca_file=`, $RHIZOME_TLS_CA) is
trusted and implies TLS; `tls=True` trusts the system's CAs; otherwise the embedded
platform's own CA (`<data dir>/tls/ca.pem`) when `address` is that platform's, the same
way as its admin token; otherwise plaintext.

High availability: `address` may list several daemons, `"HOST:PORT,HOST:PORT"` (an
active daemon and its hot standby, `rhizomed --standby`). A call that finds its daemon
UNAVAILABLE (gone, or a standby that does not lead yet) is tried against the next
address, round the list, for up to `failover_s` (default: longer than the leader
lease, so a standby has taken over by then); later calls stay on the address that
answered. Token and TLS discovery go by the first address.
"""

from __future__ import annotations

import io
import json
import os
import stat
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import grpc
from rhizome.v1 import job_pb2, scheduler_pb2, tds_pb2, trainer_pb2, trainer_pb2_grpc

from services.config import DEFAULT_DATA_DIR

USER_METADATA = "x-rhizome-user"
TOKEN_ENV = "RHIZOME_TOKEN"
TLS_CA_ENV = "RHIZOME_TLS_CA"
# How long a call goes round an address list before it gives up: the leader lease
# (services/leader/etcd.py, 2 s) plus the standby's takeover, with room to spare.
FAILOVER_S = 10.0
ADMIN_TOKEN_FILE = "admin.token"
MAX_MESSAGE = 80 * 1024 * 1024
# Code is uploaded in pieces of this size (CreateJobStream), never in one message.
UPLOAD_CHUNK = 1024 * 1024
# The most code one CreateJob message may carry (services/api/core.py MAX_UNARY_MODEL_BYTES).
MAX_UNARY_CODE = 64 * 1024 * 1024
# (bytes sent, bytes in all): what `create_job` reports as an upload goes.
Progress = Callable[[int, int], None]


class ClientError(RuntimeError):
    """A call failed; `code` is the gRPC status name, the message says what to do."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _translate(exc: grpc.RpcError, address: str, tls: bool = False) -> ClientError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    lowered = (details or "").lower()
    if code == grpc.StatusCode.UNAVAILABLE and any(
        word in lowered for word in ("ssl", "tls", "handshake", "certificate")
    ):
        return ClientError(
            code.name,
            f"TLS with the Rhizome API at {address} failed: its certificate is not one this "
            "client trusts; pass the CA that signed it with --tls-ca FILE (RHIZOME_TLS_CA)",
        )
    if code == grpc.StatusCode.UNAVAILABLE and "connect" in lowered:
        hint = (
            ""
            if tls
            else "; if it serves TLS, pass its CA with --tls-ca FILE (the embedded platform's "
            "is trusted by itself when --api is that platform's)"
        )
        return ClientError(
            code.name,
            f"cannot reach the Rhizome API at {address}; start it with `rhizome up --embedded` "
            f"or pass --api HOST:PORT{hint}",
        )
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in lowered:
        # gRPC's own refusal of an oversized message, before the API sees it.
        return ClientError(
            code.name,
            f"the request is larger than the gRPC message limit of the API at {address} "
            f"({details}); upload code with Client.create_job (it streams the archive in "
            f"pieces, up to {MAX_CODE_ZIP_BYTES // 2**20} MiB) or as multipart on POST /v1/models",
        )
    if code == grpc.StatusCode.UNIMPLEMENTED and "method not found" in lowered:
        return ClientError(
            code.name,
            f"the Rhizome API at {address} does not offer this call ({details}); it is older "
            "than this client: upgrade the platform",
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ClientError(code.name, f"the Rhizome API at {address} did not answer in time")
    return ClientError(code.name, details or code.name)


def find_token(address: str, token: str | None = None, data_dir: Path | None = None) -> str:
    """The token to call `address` with: `token`, else $RHIZOME_TOKEN, else the embedded
    platform's admin token when `address` is that platform's. Empty when there is none.

    The data directory's token is only ever sent to the platform that wrote it: a client
    pointed at another API does not hand it the local admin token."""
    if token is not None:
        return token.strip()
    env = os.environ.get(TOKEN_ENV, "").strip()
    if env:
        return env
    root = Path(data_dir).expanduser() if data_dir else DEFAULT_DATA_DIR
    if _platform_state(address, root) is None:
        return ""
    try:
        return (root / ADMIN_TOKEN_FILE).read_text().strip()
    except OSError:
        return ""


def _platform_state(address: str, root: Path) -> dict[str, Any] | None:
    """The embedded platform's `platform.json` when `address` is its API, else None."""
    try:
        state = json.loads((root / "platform.json").read_text())
        if not isinstance(state, dict):
            return None
        urls = state.get("urls", {})
        if address not in (urls.get("api"), urls.get("api-standby")):
            return None
        return state
    except (OSError, ValueError, AttributeError):
        return None


def _read_ca(path: str | Path, where: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ClientError(
            "INVALID_ARGUMENT", f"cannot read the CA certificate {path} ({where}): {exc.strerror}"
        ) from None


def find_tls(
    address: str,
    tls: bool | None = None,
    ca_file: str | Path | None = None,
    data_dir: Path | None = None,
) -> tuple[bool, bytes | None]:
    """Whether to call `address` over TLS, and the CA to trust (None: the system's).
    The order is the module docstring's."""
    if tls is False:
        return False, None
    if ca_file:
        return True, _read_ca(ca_file, "--tls-ca")
    env = os.environ.get(TLS_CA_ENV, "").strip()
    if env:
        return True, _read_ca(env, f"${TLS_CA_ENV}")
    if tls:
        return True, None
    root = Path(data_dir).expanduser() if data_dir else DEFAULT_DATA_DIR
    state = _platform_state(address, root)
    if not state or not state.get("tls"):
        return False, None
    ca = state.get("tls_ca")
    return True, (_read_ca(ca, f"the embedded platform's CA in {root}") if ca else None)


# What the API takes (services/api/core.py, services/api/archive.py): checked here first so
# that a wrong folder fails before minutes of zipping and uploading, naming the folder.
MAX_CODE_ZIP_BYTES = 512 * 1024 * 1024  # the streamed limit (MAX_MODEL_BYTES there)
MAX_CODE_TOTAL_BYTES = 1024 * 1024 * 1024
MAX_CODE_FILES = 10_000
_SKIPPED_DIRS = {"__pycache__", ".git", ".venv", ".mypy_cache", ".pytest_cache", ".ruff_cache"}


def zip_directory(path: Path) -> bytes:
    """Zip a code directory (skipping caches and VCS metadata) for `create_job`.

    Refuses, naming the file or the folder and the limit: a socket, FIFO or device file
    (nothing to upload; it also breaks zipping), more files or bytes than the API takes.
    """
    root = Path(path)
    if not root.is_dir():
        raise ClientError("INVALID_ARGUMENT", f"code directory {root} does not exist")
    hint = "pass the folder with only your training code (rhizome train MANIFEST CODE_DIR)"
    buf = io.BytesIO()
    files = total = 0
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
            for name in sorted(filenames):
                file = Path(dirpath) / name
                try:
                    st = file.stat()
                except OSError as exc:  # a dangling link, a file gone meanwhile
                    raise ClientError(
                        "INVALID_ARGUMENT", f"cannot read {file}: {exc.strerror}; {hint}"
                    ) from None
                if not stat.S_ISREG(st.st_mode):
                    raise ClientError(
                        "INVALID_ARGUMENT",
                        f"{file} is not a regular file (a socket, pipe or device) and cannot "
                        f"be uploaded; {hint}",
                    )
                files += 1
                total += st.st_size
                if files > MAX_CODE_FILES or total > MAX_CODE_TOTAL_BYTES:
                    raise ClientError(
                        "RESOURCE_EXHAUSTED",
                        f"{root} holds more than {MAX_CODE_FILES} files or "
                        f"{MAX_CODE_TOTAL_BYTES // 2**20} MiB; {hint}, and keep data in a data store",
                    )
                zf.write(file, file.relative_to(root).as_posix())
                if buf.tell() > MAX_CODE_ZIP_BYTES:
                    raise ClientError(
                        "RESOURCE_EXHAUSTED",
                        f"{root} zips to more than {MAX_CODE_ZIP_BYTES // 2**20} MiB, the "
                        f"API's limit for code; {hint}, and keep data in a data store",
                    )
    return buf.getvalue()


class Client:
    def __init__(
        self,
        address: str,
        user: str | None = None,
        timeout_s: float = 30.0,
        token: str | None = None,
        data_dir: Path | None = None,
        tls: bool | None = None,
        ca_file: str | Path | None = None,
        failover_s: float = FAILOVER_S,
    ) -> None:
        """`token=None` looks for one (see `find_token`); `token=""` sends none.
        `tls=None` decides by `find_tls`; `tls=False` is plaintext. `address` may be a
        comma-separated list of daemons (see the module docstring)."""
        self.addresses = [a.strip() for a in address.split(",") if a.strip()] or [address]
        self.address = self.addresses[0]
        self.failover_s = failover_s
        self.user = user or os.environ.get("RHIZOME_USER") or os.environ.get("USER") or "anonymous"
        self.token = find_token(self.address, token, data_dir)
        self.timeout_s = timeout_s
        self.tls, self._ca = find_tls(self.address, tls, ca_file, data_dir)
        self._connect(self.address)
        # A token says who the caller is; the bare user id is for FfDL-compatible daemons.
        self._md: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {self.token}"),)
            if self.token
            else ((USER_METADATA, self.user),)
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _connect(self, address: str) -> None:
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            # A daemon its supervisor restarts serves again in about half a second, but
            # gRPC's first reconnect backoff (1 s, +-20 %) kept a long-lived client away
            # for that long (benchmarks/recovery.py timed the client, not the daemon).
            # Not grpc.min_reconnect_backoff_ms: that one is each attempt's connect
            # timeout (contract/etcd.py says how it failed calls there).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 5000),
        ]
        if self.tls:
            credentials = grpc.ssl_channel_credentials(root_certificates=self._ca)
            self._channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = trainer_pb2_grpc.TrainerStub(self._channel)
        self.address = address

    def _fail_over(self, exc: grpc.RpcError, deadline: float, tried: int) -> bool:
        """After an UNAVAILABLE from one of several daemons: connect to the next one and
        say whether to try again (False: one address only, another error, or time up)."""
        code = exc.code() if hasattr(exc, "code") else None
        if len(self.addresses) < 2 or code != grpc.StatusCode.UNAVAILABLE:
            return False
        if time.monotonic() >= deadline:
            return False
        if tried % len(self.addresses) == 0:
            time.sleep(0.02)  # every daemon refused just now: a standby is taking over
        following = self.addresses[(self.addresses.index(self.address) + 1) % len(self.addresses)]
        self._channel.close()
        self._connect(following)
        return True

    def _call(self, method: str, request: object, timeout: float | None = None) -> object:
        deadline = time.monotonic() + self.failover_s
        tried = 0
        while True:
            try:
                return getattr(self._stub, method)(
                    request, metadata=self._md, timeout=timeout or self.timeout_s
                )
            except grpc.RpcError as exc:
                tried += 1
                if not self._fail_over(exc, deadline, tried):
                    raise _translate(exc, self.address, self.tls) from None

    # -- jobs ------------------------------------------------------------------------------
    def create_job(
        self,
        manifest_yaml: str,
        code_zip: bytes = b"",
        idempotency_key: str | None = None,
        progress: Progress | None = None,
    ) -> trainer_pb2.CreateJobResponse:
        """Submit a job. Code is streamed in UPLOAD_CHUNK pieces (CreateJobStream), so an
        archive larger than one gRPC message uploads; `progress(sent, total)` is called
        after each piece."""
        # A key per call makes the SDK's own retries safe; callers may pass theirs.
        key = idempotency_key if idempotency_key is not None else uuid.uuid4().hex
        header = trainer_pb2.CreateJobRequest(manifest_yaml=manifest_yaml, idempotency_key=key)
        if not code_zip:
            resp = self._call("CreateJob", header)
            assert isinstance(resp, trainer_pb2.CreateJobResponse)
            return resp

        def pieces() -> Iterator[trainer_pb2.CreateJobChunk]:
            yield trainer_pb2.CreateJobChunk(header=header)
            for start in range(0, len(code_zip), UPLOAD_CHUNK):
                piece = code_zip[start : start + UPLOAD_CHUNK]
                yield trainer_pb2.CreateJobChunk(data=piece)
                if progress is not None:
                    progress(start + len(piece), len(code_zip))

        # The deadline grows with the upload: a slow link still gets its archive through.
        timeout = self.timeout_s + len(code_zip) / (1024 * 1024)
        deadline, tried = time.monotonic() + self.failover_s, 0
        while True:
            try:
                streamed = self._stub.CreateJobStream(pieces(), metadata=self._md, timeout=timeout)
                break
            except grpc.RpcError as exc:
                tried += 1
                # The idempotency key makes sending it again to the next daemon safe.
                if self._fail_over(exc, deadline, tried):
                    continue
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED and len(code_zip) <= MAX_UNARY_CODE:
                    # A daemon from before CreateJobStream: code that fits one message goes.
                    header.model_definition = code_zip
                    resp = self._call("CreateJob", header, timeout=timeout)
                    assert isinstance(resp, trainer_pb2.CreateJobResponse)
                    return resp
                raise _translate(exc, self.address, self.tls) from None
        assert isinstance(streamed, trainer_pb2.CreateJobResponse)
        return streamed

    def get_job(self, job_id: str) -> job_pb2.Job:
        resp = self._call("GetJob", trainer_pb2.GetJobRequest(job_id=job_id))
        assert isinstance(resp, job_pb2.Job)
        return resp

    def list_jobs(
        self,
        statuses: list[str] | None = None,
        name_prefix: str = "",
        page_size: int = 50,
        page_token: str = "",
    ) -> trainer_pb2.ListJobsResponse:
        try:
            wanted = [job_pb2.JobStatus.Value(s.upper()) for s in statuses or []]
        except ValueError as exc:
            raise ClientError("INVALID_ARGUMENT", f"unknown status: {exc}") from None
        req = trainer_pb2.ListJobsRequest(
            statuses=wanted, name_prefix=name_prefix, page_size=page_size, page_token=page_token
        )
        resp = self._call("ListJobs", req)
        assert isinstance(resp, trainer_pb2.ListJobsResponse)
        return resp

    def iter_jobs(
        self, statuses: list[str] | None = None, name_prefix: str = ""
    ) -> Iterator[job_pb2.Job]:
        token = ""
        while True:
            page = self.list_jobs(statuses, name_prefix, page_size=500, page_token=token)
            yield from page.jobs
            token = page.next_page_token
            if not token:
                return

    def _job_call(self, method: str, job_id: str, reason: str = "") -> job_pb2.Job:
        resp = self._call(method, trainer_pb2.JobRequest(job_id=job_id, reason=reason))
        assert isinstance(resp, job_pb2.Job)
        return resp

    def halt_job(self, job_id: str, reason: str = "") -> job_pb2.Job:
        return self._job_call("HaltJob", job_id, reason)

    def resume_job(self, job_id: str, reason: str = "") -> job_pb2.Job:
        return self._job_call("ResumeJob", job_id, reason)

    def delete_job(self, job_id: str, reason: str = "") -> job_pb2.Job:
        return self._job_call("DeleteJob", job_id, reason)

    def scale_job(self, job_id: str, learners: int) -> job_pb2.Job:
        resp = self._call("ScaleJob", trainer_pb2.ScaleJobRequest(job_id=job_id, learners=learners))
        assert isinstance(resp, job_pb2.Job)
        return resp

    # -- downloads (FfDL's /definition and /trained_model) ------------------------------------
    def download_model_definition(self, job_id: str, out: IO[bytes]) -> int:
        """Write the job's code archive (a zip) to `out`; the number of bytes written."""
        return self._download(self._stub.DownloadModelDefinition, job_id, out)

    def download_trained_model(self, job_id: str, out: IO[bytes]) -> int:
        """Write a zip of what the job's learners stored as results (`<rank>/<path>`)."""
        return self._download(self._stub.DownloadTrainedModel, job_id, out)

    def _download(self, method: Any, job_id: str, out: IO[bytes]) -> int:
        written = 0
        for chunk in self._stream(method, trainer_pb2.GetJobRequest(job_id=job_id)):
            out.write(chunk.data)
            written += len(chunk.data)
        return written

    # -- events (webhooks) ------------------------------------------------------------------
    def create_event_endpoint(
        self, job_id: str, event_type: str, url: str, endpoint_id: str = ""
    ) -> trainer_pb2.CreateEventEndpointResponse:
        """Register a webhook; its signing secret is in this response and nowhere else."""
        req = trainer_pb2.CreateEventEndpointRequest(
            job_id=job_id, event_type=event_type, url=url, endpoint_id=endpoint_id
        )
        resp = self._call("CreateEventEndpoint", req)
        assert isinstance(resp, trainer_pb2.CreateEventEndpointResponse)
        return resp

    def list_event_endpoints(
        self, job_id: str, event_type: str = ""
    ) -> list[trainer_pb2.EventEndpoint]:
        req = trainer_pb2.ListEventEndpointsRequest(job_id=job_id, event_type=event_type)
        resp = self._call("ListEventEndpoints", req)
        assert isinstance(resp, trainer_pb2.ListEventEndpointsResponse)
        return list(resp.endpoints)

    def delete_event_endpoint(
        self, job_id: str, event_type: str, endpoint_id: str
    ) -> trainer_pb2.EventEndpoint:
        req = trainer_pb2.EventEndpointRequest(
            job_id=job_id, event_type=event_type, endpoint_id=endpoint_id
        )
        resp = self._call("DeleteEventEndpoint", req)
        assert isinstance(resp, trainer_pb2.EventEndpoint)
        return resp

    # -- streams --------------------------------------------------------------------------------
    def logs(self, request: tds_pb2.LogsRequest) -> Iterator[tds_pb2.LogLine]:
        return self._stream(self._stub.StreamLogs, request)

    def metrics(self, request: tds_pb2.MetricsRequest) -> Iterator[tds_pb2.MetricSample]:
        return self._stream(self._stub.StreamMetrics, request)

    def _stream(self, method: Any, request: Any) -> Iterator[Any]:
        """A server stream with errors translated; cancelled when the caller stops reading."""
        call = method(request, metadata=self._md)
        try:
            yield from call
        except grpc.RpcError as exc:
            raise _translate(exc, self.address, self.tls) from None
        finally:
            call.cancel()

    # -- tokens (admin tokens only) -----------------------------------------------------------
    def create_token(
        self, user: str = "", role: str = "user", expires_in_s: int = 0, description: str = ""
    ) -> trainer_pb2.CreateTokenResponse:
        """A new token acting as `user` (default: you). Its secret is in this response only."""
        req = trainer_pb2.CreateTokenRequest(
            user=user, role=role, expires_in_seconds=expires_in_s, description=description
        )
        resp = self._call("CreateToken", req)
        assert isinstance(resp, trainer_pb2.CreateTokenResponse)
        return resp

    def list_tokens(self) -> list[trainer_pb2.Token]:
        resp = self._call("ListTokens", trainer_pb2.ListTokensRequest())
        assert isinstance(resp, trainer_pb2.ListTokensResponse)
        return list(resp.tokens)

    def revoke_token(self, token_id: str) -> trainer_pb2.Token:
        resp = self._call("RevokeToken", trainer_pb2.RevokeTokenRequest(token_id=token_id))
        assert isinstance(resp, trainer_pb2.Token)
        return resp

    # -- platform ------------------------------------------------------------------------------
    def cluster(self) -> scheduler_pb2.ClusterView:
        resp = self._call("GetCluster", scheduler_pb2.GetClusterRequest())
        assert isinstance(resp, scheduler_pb2.ClusterView)
        return resp

    def version(self) -> trainer_pb2.VersionInfo:
        resp = self._call("GetVersion", trainer_pb2.GetVersionRequest(), timeout=5)
        assert isinstance(resp, trainer_pb2.VersionInfo)
        return resp
