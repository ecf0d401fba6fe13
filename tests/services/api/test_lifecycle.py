"""The API forwards halt/resume/delete/scale of deployed jobs to the LCM as typed
requests; scaling a running job reaches the LCM as an LcmScaleRequest with the count,
and an LCM's refusal reaches the user as FAILED_PRECONDITION with its reason (the LCM's
own checks: tests/services/guardian/test_elastic.py)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from rhizome.v1 import lcm_pb2, lcm_pb2_grpc

from contract.procs import free_port
from services.api import errors
from services.api.core import TrainerCore
from services.api.hosting import lifecycle_client
from services.lcm.servicer import LifecycleServicer
from services.manifest import parse_manifest
from services.store import states
from services.store.errors import JobNotFound
from services.store.jobs import JobRecord
from services.store.objects import LocalObjectStore

JOB = "job-0001"


class RecordingLcm(LifecycleServicer):
    """Every request recorded; ScaleJob refused as an LCM refuses (FAILED_PRECONDITION),
    halt/resume/kill accepted, all without a manager."""

    def __init__(self) -> None:
        super().__init__(manager=None)  # type: ignore[arg-type]
        self.requests: list[tuple[str, Any]] = []

    def ScaleJob(self, request: Any, context: Any) -> Any:
        self.requests.append(("ScaleJob", request))
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"job {request.job_id}: refused")

    def _record(self, method: str, request: Any) -> lcm_pb2.LcmResponse:
        self.requests.append((method, request))
        return lcm_pb2.LcmResponse(accepted=True, message=f"{method} {request.job_id}")

    def HaltJob(self, request: Any, context: Any) -> Any:
        return self._record("HaltJob", request)

    def ResumeJob(self, request: Any, context: Any) -> Any:
        return self._record("ResumeJob", request)

    def KillJob(self, request: Any, context: Any) -> Any:
        return self._record("KillJob", request)


class Jobs:
    """The one job the tests need, in place of the MongoDB repository."""

    def __init__(self, job: JobRecord) -> None:
        self.job = job

    def get(self, job_id: str, owner: str | None = None) -> JobRecord:
        if job_id != self.job.job_id or owner not in (None, self.job.owner):
            raise JobNotFound(job_id)
        return self.job

    def update_fields(self, job_id: str, **fields: Any) -> JobRecord:
        self.job = dataclasses.replace(self.get(job_id), **fields)
        return self.job


def elastic_job(status: str) -> JobRecord:
    manifest = parse_manifest(
        json.dumps(
            {
                "name": "e",
                "learners": 2,
                "elastic": {"min": 1, "max": 4},
                "framework": {"command": "python t.py"},
            }
        )
    )
    return JobRecord.for_manifest(JOB, "alice", manifest, status=status)


@pytest.fixture
def lcm() -> Iterator[tuple[RecordingLcm, grpc.Channel]]:
    servicer = RecordingLcm()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    lcm_pb2_grpc.add_LifecycleManagerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield servicer, channel
    finally:
        channel.close()
        server.stop(0)


def core_for(job: JobRecord, channel: grpc.Channel, tmp_path: Path) -> TrainerCore:
    return TrainerCore(
        Jobs(job),  # type: ignore[arg-type]
        LocalObjectStore(tmp_path),
        lifecycle=lifecycle_client(channel),
    )


def test_scaling_a_running_job_reaches_the_lcm_typed_and_a_refusal_is_a_conflict(
    lcm: tuple[RecordingLcm, grpc.Channel], tmp_path: Path
) -> None:
    servicer, channel = lcm
    core = core_for(elastic_job(states.PROCESSING), channel, tmp_path)
    with pytest.raises(errors.Conflict) as info:
        core.scale("alice", JOB, 3)
    [(method, request)] = servicer.requests
    assert method == "ScaleJob"
    assert isinstance(request, lcm_pb2.LcmScaleRequest)
    assert (request.job_id, request.learners) == (JOB, 3)
    assert request.reason == "scaled to 3 learners by alice"
    assert info.value.message == f"job {JOB}: refused"
    # The API answers FAILED_PRECONDITION (HTTP 409), not "unavailable".
    assert info.value.grpc_code == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize("status", [states.PENDING, states.DEPLOYING, states.STORING])
def test_a_job_that_is_deployed_but_not_processing_is_not_scaled(
    lcm: tuple[RecordingLcm, grpc.Channel], tmp_path: Path, status: str
) -> None:
    servicer, channel = lcm
    core = core_for(elastic_job(status), channel, tmp_path)
    with pytest.raises(errors.Conflict, match=f"is {status}: a running elastic job is scaled"):
        core.scale("alice", JOB, 3)
    assert servicer.requests == []


def test_a_halted_job_is_scaled_in_its_record_without_the_lcm(
    lcm: tuple[RecordingLcm, grpc.Channel], tmp_path: Path
) -> None:
    servicer, channel = lcm
    core = core_for(elastic_job(states.HALTED), channel, tmp_path)
    assert core.scale("alice", JOB, 3).resources["learners"] == 3
    assert servicer.requests == []


def test_halt_resume_delete_travel_as_typed_requests(
    lcm: tuple[RecordingLcm, grpc.Channel], tmp_path: Path
) -> None:
    servicer, channel = lcm
    client = lifecycle_client(channel)
    assert client is not None
    assert client.halt(JOB, "h") == f"HaltJob {JOB}"
    assert client.resume(JOB, "r") == f"ResumeJob {JOB}"
    assert client.delete(JOB, "d") == f"KillJob {JOB}"
    assert [(m, r.job_id, r.reason) for m, r in servicer.requests] == [
        ("HaltJob", JOB, "h"),
        ("ResumeJob", JOB, "r"),
        ("KillJob", JOB, "d"),
    ]
    assert all(isinstance(r, lcm_pb2.LcmJobRequest) for _, r in servicer.requests)


def test_an_unreachable_lcm_is_unavailable() -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{free_port()}")
    client = lifecycle_client(channel)
    assert client is not None
    with pytest.raises(errors.Unavailable, match="lifecycle manager is unavailable"):
        client.scale(JOB, 2, "scaled by user")
    channel.close()


def test_no_lcm_channel_means_no_lifecycle_port() -> None:
    assert lifecycle_client(None) is None


@pytest.mark.parametrize(
    ("action", "method", "reason"),
    [("halt", "HaltJob", "halted by user"), ("delete", "KillJob", "deleted by user")],
)
def test_halting_or_deleting_a_deployed_job_through_the_api_reaches_the_lcm(
    lcm: tuple[RecordingLcm, grpc.Channel], tmp_path: Path, action: str, method: str, reason: str
) -> None:
    servicer, channel = lcm
    core = core_for(elastic_job(states.PROCESSING), channel, tmp_path)
    getattr(core, action)("alice", JOB)
    assert [(m, r.job_id, r.reason) for m, r in servicer.requests] == [(method, JOB, reason)]
