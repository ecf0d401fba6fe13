"""The Python SDK: a client of the public Trainer API only (gRPC).

from services.client.sdk import Client
with Client("127.0.0.1:50051", user="alice") as rz:
    job = rz.create_job(open("manifest.yml").read(), code_zip=zip_dir("src/"))
    print(rz.get_job(job.job_id).status)
"""

from __future__ import annotations

import io
import os
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from rhizome.v1 import job_pb2, scheduler_pb2, tds_pb2, trainer_pb2, trainer_pb2_grpc

USER_METADATA = "x-rhizome-user"
MAX_MESSAGE = 80 * 1024 * 1024


class ClientError(RuntimeError):
    """A call failed; `code` is the gRPC status name, the message says what to do."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _translate(exc: grpc.RpcError, address: str) -> ClientError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAVAILABLE and ("connect" in (details or "").lower()):
        return ClientError(
            code.name,
            f"cannot reach the Rhizome API at {address}; start it with `rhizome up --embedded` "
            "or pass --api HOST:PORT",
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ClientError(code.name, f"the Rhizome API at {address} did not answer in time")
    return ClientError(code.name, details or code.name)


def zip_directory(path: Path) -> bytes:
    """Zip a code directory (skipping caches and VCS metadata) for `create_job`."""
    root = Path(path)
    if not root.is_dir():
        raise ClientError("INVALID_ARGUMENT", f"code directory {root} does not exist")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for file in sorted(root.rglob("*")):
            rel = file.relative_to(root)
            if (
                any(part in {"__pycache__", ".git", ".venv"} for part in rel.parts)
                or not file.is_file()
            ):
                continue
            zf.write(file, rel.as_posix())
    return buf.getvalue()


class Client:
    def __init__(self, address: str, user: str | None = None, timeout_s: float = 30.0) -> None:
        self.address = address
        self.user = user or os.environ.get("RHIZOME_USER") or os.environ.get("USER") or "anonymous"
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE),
                ("grpc.max_receive_message_length", MAX_MESSAGE),
            ],
        )
        self._stub = trainer_pb2_grpc.TrainerStub(self._channel)
        self._md = ((USER_METADATA, self.user),)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request: object, timeout: float | None = None) -> object:
        try:
            return getattr(self._stub, method)(
                request, metadata=self._md, timeout=timeout or self.timeout_s
            )
        except grpc.RpcError as exc:
            raise _translate(exc, self.address) from None

    # -- jobs ------------------------------------------------------------------------------
    def create_job(
        self, manifest_yaml: str, code_zip: bytes = b"", idempotency_key: str | None = None
    ) -> trainer_pb2.CreateJobResponse:
        # A key per call makes the SDK's own retries safe; callers may pass theirs.
        key = idempotency_key if idempotency_key is not None else uuid.uuid4().hex
        req = trainer_pb2.CreateJobRequest(
            manifest_yaml=manifest_yaml, model_definition=code_zip, idempotency_key=key
        )
        resp = self._call("CreateJob", req)
        assert isinstance(resp, trainer_pb2.CreateJobResponse)
        return resp

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
            raise _translate(exc, self.address) from None
        finally:
            call.cancel()

    # -- platform ------------------------------------------------------------------------------
    def cluster(self) -> scheduler_pb2.ClusterView:
        resp = self._call("GetCluster", scheduler_pb2.GetClusterRequest())
        assert isinstance(resp, scheduler_pb2.ClusterView)
        return resp

    def version(self) -> trainer_pb2.VersionInfo:
        resp = self._call("GetVersion", trainer_pb2.GetVersionRequest(), timeout=5)
        assert isinstance(resp, trainer_pb2.VersionInfo)
        return resp
