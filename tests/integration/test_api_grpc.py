"""The Trainer API over gRPC, against the real MongoDB-wire server."""

from __future__ import annotations

import io
import uuid
import zipfile

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from rhizome.v1 import job_pb2, trainer_pb2, trainer_pb2_grpc

from services.client.sdk import ClientError
from tests.integration.conftest import RunningApi

pytestmark = pytest.mark.integration

MANIFEST = "name: {name}\nlearners: 1\nframework:\n  command: python train.py\n"


def code_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("train.py", "print('hello')\n")
    return buf.getvalue()


def user() -> str:
    return f"u-{uuid.uuid4().hex[:8]}"


def test_submit_is_stored_before_the_id_returns(api: RunningApi) -> None:
    # One archive, built once: zip entries carry the wall-clock time, so two builds
    # straddling a 2-second boundary differ.
    archive = code_zip()
    with api.client(user()) as rz:
        resp = rz.create_job(MANIFEST.format(name="a"), archive)
        assert resp.job_id.startswith("job-")
        job = rz.get_job(resp.job_id)
    assert job.status == job_pb2.QUEUED
    assert [h.status for h in job.history] == [job_pb2.QUEUED]
    assert (api.data_dir / "objects" / "models" / f"{resp.job_id}.zip").read_bytes() == archive


def test_a_retried_submit_with_the_same_key_returns_the_same_job(api: RunningApi) -> None:
    with api.client(user()) as rz:
        first = rz.create_job(MANIFEST.format(name="b"), b"", idempotency_key="retry-1")
        again = rz.create_job(MANIFEST.format(name="b"), b"", idempotency_key="retry-1")
        assert again.existing and again.job_id == first.job_id
        with pytest.raises(ClientError) as info:
            rz.create_job(MANIFEST.format(name="other"), b"", idempotency_key="retry-1")
        assert info.value.code == "FAILED_PRECONDITION"
        assert "already used" in info.value.message
        assert [j.job_id for j in rz.iter_jobs()] == [first.job_id]


def test_users_see_only_their_own_jobs(api: RunningApi) -> None:
    with api.client(user()) as alice, api.client(user()) as bob:
        job = alice.create_job(MANIFEST.format(name="mine")).job_id
        with pytest.raises(ClientError) as info:
            bob.get_job(job)
        assert info.value.code == "NOT_FOUND"
        with pytest.raises(ClientError):
            bob.delete_job(job)
        assert list(bob.iter_jobs()) == []
        assert alice.get_job(job).status == job_pb2.QUEUED


def test_list_filters_and_pages(api: RunningApi) -> None:
    with api.client(user()) as rz:
        ids = [rz.create_job(MANIFEST.format(name=f"p{i}")).job_id for i in range(5)]
        rz.halt_job(ids[1])
        page = rz.list_jobs(page_size=2)
        assert [j.job_id for j in page.jobs] == [ids[4], ids[3]]
        assert page.next_page_token
        assert [j.job_id for j in rz.iter_jobs(["HALTED"])] == [ids[1]]
        assert [j.job_id for j in rz.iter_jobs(name_prefix="p3")] == [ids[3]]


def test_halt_resume_delete_of_a_queued_job(api: RunningApi) -> None:
    with api.client(user()) as rz:
        job = rz.create_job(MANIFEST.format(name="h")).job_id
        assert rz.halt_job(job).status == job_pb2.HALTED
        assert rz.halt_job(job).status == job_pb2.HALTED  # a retry is a no-op
        assert rz.resume_job(job).status == job_pb2.QUEUED
        assert rz.delete_job(job).status == job_pb2.DELETED
        with pytest.raises(ClientError) as info:
            rz.resume_job(job)
        assert info.value.code == "FAILED_PRECONDITION"
        hist = [h.status for h in rz.get_job(job).history]
    assert hist == [1, 9, 1, 13]  # QUEUED HALTED QUEUED DELETED


@pytest.mark.parametrize(
    ("manifest", "fragment"),
    [
        ("name: x\nframework: {command: c}\nlearners: -3", "learners: -3 is less than the minimum"),
        ("name: x\nframework: {command: c}\nbogus: 1", "bogus: unknown field"),
        ("name: x\n  framework: [", "not valid YAML"),
        ("name: x\nframework: {}", "framework.command: is required"),
    ],
)
def test_bad_manifests_are_refused_and_nothing_is_stored(
    api: RunningApi, manifest: str, fragment: str
) -> None:
    with api.client(user()) as rz:
        with pytest.raises(ClientError) as info:
            rz.create_job(manifest)
        assert info.value.code == "INVALID_ARGUMENT"
        assert fragment in info.value.message
        assert list(rz.iter_jobs()) == []


def test_a_bad_zip_and_an_oversized_upload_are_refused(api: RunningApi) -> None:
    with api.client(user()) as rz:
        with pytest.raises(ClientError, match="not a valid zip"):
            rz.create_job(MANIFEST.format(name="z"), b"not a zip")
        # Over the one-message limit on the unary CreateJob (the SDK itself streams): the
        # refusal names the limit and the way to upload larger code.
        oversized = trainer_pb2.CreateJobRequest(
            manifest_yaml=MANIFEST.format(name="z"), model_definition=b"0" * (65 * 1024 * 1024)
        )
        with pytest.raises(grpc.RpcError) as raw:
            rz._stub.CreateJob(oversized, metadata=rz._md, timeout=60)
        assert raw.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "at most 67108864" in raw.value.details()
        assert "CreateJobStream" in raw.value.details()
        assert list(rz.iter_jobs()) == []
    models = api.data_dir / "objects" / "models"
    assert not models.exists() or all(p.suffix == ".zip" for p in models.iterdir())


def test_unknown_ids_and_missing_user_get_clear_errors(api: RunningApi) -> None:
    with api.client(user()) as rz, pytest.raises(ClientError, match="no job 'job-missing'"):
        rz.get_job("job-missing")
    channel = grpc.insecure_channel(api.grpc)
    stub = trainer_pb2_grpc.TrainerStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.ListJobs(trainer_pb2.ListJobsRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()


def test_health_and_reflection_are_served(api: RunningApi) -> None:
    channel = grpc.insecure_channel(api.grpc)
    health = health_pb2_grpc.HealthStub(channel)
    resp = health.Check(health_pb2.HealthCheckRequest(service="rhizome.v1.Trainer"), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert "rhizome.v1.Trainer" in names
    channel.close()


def test_a_dropped_client_mid_submit_leaves_no_partial_record(api: RunningApi) -> None:
    owner = user()
    channel = grpc.insecure_channel(api.grpc)
    stub = trainer_pb2_grpc.TrainerStub(channel)
    future = stub.CreateJob.future(
        trainer_pb2.CreateJobRequest(
            manifest_yaml=MANIFEST.format(name="drop"), model_definition=code_zip()
        ),
        metadata=(("authorization", f"Bearer {api.token(owner)}"),),
        timeout=10,
    )
    future.cancel()
    channel.close()
    with api.client(owner) as rz:
        jobs = list(rz.iter_jobs())
        # Either the submit landed whole (acknowledged or not) or nothing did.
        for job in jobs:
            assert job.status == job_pb2.QUEUED
            assert (api.data_dir / "objects" / "models" / f"{job.job_id}.zip").exists()
        assert len(jobs) <= 1


@pytest.mark.parametrize(
    "payload",
    [b"\x0a\x02\xff\xfe", b"\x0a\xff\xff\xff\xff\x0f", b"\x08", b"\x0f"],
    ids=["not-utf8", "length-past-the-end", "truncated-varint", "no-such-wire-type"],
)
def test_bytes_that_are_not_a_message_are_invalid_argument_not_internal(
    api: RunningApi, payload: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by the gRPC fuzzer: grpc answered INTERNAL and logged a traceback per call."""
    md = [("authorization", f"Bearer {api.token(user())}")]
    with grpc.insecure_channel(api.grpc) as channel:
        for method, streaming in [("GetJob", False), ("StreamLogs", True)]:
            path = f"/rhizome.v1.Trainer/{method}"
            with pytest.raises(grpc.RpcError) as err:
                if streaming:
                    list(channel.unary_stream(path)(payload, metadata=md, timeout=10))
                else:
                    channel.unary_unary(path)(payload, metadata=md, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert "not a valid message" in err.value.details()
        # A well-formed call still works on the same channel.
        ok = trainer_pb2_grpc.TrainerStub(channel).ListJobs(
            trainer_pb2.ListJobsRequest(), metadata=md, timeout=10
        )
        assert list(ok.jobs) == []
    assert not [r for r in caplog.records if r.levelno >= 40 and r.name.startswith("grpc")]


def test_free_text_fields_are_bounded_so_a_job_stays_controllable(api: RunningApi) -> None:
    """Found by the gRPC fuzzer: a halt/resume reason is kept in the job's history and was
    unbounded; four 2 MB reasons pushed the record past MongoDB's 16 MB document limit,
    after which no halt, resume or delete of that job could be stored."""
    with api.client(user()) as rz:
        job_id = rz.create_job(MANIFEST.format(name="bounded")).job_id
        for call in (rz.halt_job, rz.resume_job, rz.delete_job):
            with pytest.raises(ClientError) as err:
                call(job_id, "r" * (2 * 1024 * 1024))
            assert err.value.code == "INVALID_ARGUMENT" and "reason" in err.value.message
        assert rz.halt_job(job_id, "r" * 1024).status == job_pb2.HALTED
        for request in (
            trainer_pb2.ListJobsRequest(name_prefix="n" * 129),
            trainer_pb2.ListJobsRequest(page_token="t" * 257),
        ):
            with pytest.raises(ClientError) as err:
                rz._call("ListJobs", request)
            assert err.value.code == "INVALID_ARGUMENT", err.value
        with pytest.raises(ClientError) as err:
            rz.get_job("j" * 4096)
        assert err.value.code == "INVALID_ARGUMENT" and "job_id" in err.value.message
        assert rz.delete_job(job_id).status == job_pb2.DELETED
