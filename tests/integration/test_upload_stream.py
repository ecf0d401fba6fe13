"""Code upload in pieces (CreateJobStream) through the real daemon and MongoDB-wire
server: larger than one gRPC message, the archive checks on the streamed bytes, the
streamed limit, and a client that goes away mid-upload."""

from __future__ import annotations

import io
import os
import threading
import uuid
import zipfile
from collections.abc import Iterator

import grpc
import pytest
from rhizome.v1 import trainer_pb2

from services.api import core as api_core
from services.api import servicer as api_servicer
from services.client.sdk import ClientError
from tests.integration.conftest import RunningApi

pytestmark = pytest.mark.integration

MANIFEST = "name: {name}\nframework:\n  command: python train.py\n"
MESSAGE_LIMIT = 80 * 1024 * 1024  # services/daemon.py: the public port's receive limit


def user() -> str:
    return f"s-{uuid.uuid4().hex[:8]}"


def stored_models(api: RunningApi) -> set[str]:
    models = api.data_dir / "objects" / "models"
    return {p.name for p in models.iterdir()} if models.exists() else set()


def test_code_larger_than_one_grpc_message_is_streamed_and_stored_whole(api: RunningApi) -> None:
    # Random bytes do not compress: the zip is larger than the gRPC message limit.
    payload = os.urandom(MESSAGE_LIMIT + 4 * 1024 * 1024)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("train.py", "print('big')\n")
        zf.writestr("weights.bin", payload)
    archive = buf.getvalue()
    assert len(archive) > MESSAGE_LIMIT
    seen: list[tuple[int, int]] = []
    with api.client(user(), timeout_s=120) as rz:
        job = rz.create_job(
            MANIFEST.format(name="big"), archive, progress=lambda s, t: seen.append((s, t))
        ).job
        out = io.BytesIO()
        assert rz.download_model_definition(job.job_id, out) == len(archive)
    assert out.getvalue() == archive
    assert seen[-1] == (len(archive), len(archive)) and len(seen) > 1


def test_the_archive_checks_apply_to_streamed_code(api: RunningApi) -> None:
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("train.py", b"\0" * (8 * 1024 * 1024))
    many = io.BytesIO()
    with zipfile.ZipFile(many, "w") as zf:
        for i in range(10_001):
            zf.writestr(f"f{i}.py", "")
    before = stored_models(api)
    with api.client(user()) as rz:
        with pytest.raises(ClientError, match="zip bomb") as info:
            rz.create_job(MANIFEST.format(name="bomb"), bomb.getvalue())
        assert info.value.code == "RESOURCE_EXHAUSTED"
        with pytest.raises(ClientError, match="members; at most"):
            rz.create_job(MANIFEST.format(name="many"), many.getvalue())
        with pytest.raises(ClientError, match="not a valid zip"):
            rz.create_job(MANIFEST.format(name="junk"), b"junk" * 1000)
        assert list(rz.iter_jobs()) == []
    assert stored_models(api) == before


def test_code_over_the_streamed_limit_is_refused_naming_it(
    api: RunningApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real limit is 512 MiB; a smaller one in this process makes the test quick.
    limit = 3 * 1024 * 1024
    monkeypatch.setattr(api_servicer, "MAX_MODEL_BYTES", limit)
    monkeypatch.setattr(api_core, "MAX_MODEL_BYTES", limit)
    with api.client(user()) as rz:
        with pytest.raises(ClientError) as info:
            rz.create_job(MANIFEST.format(name="over"), b"0" * (limit + 1))
        assert info.value.code == "RESOURCE_EXHAUSTED"
        assert f"at most {limit}" in info.value.message
        assert list(rz.iter_jobs()) == []


def test_a_bad_manifest_is_refused_before_the_code_is_read(api: RunningApi) -> None:
    with api.client(user()) as rz:
        with pytest.raises(ClientError, match="bad manifest") as info:
            rz.create_job("name: x\n", b"0" * (2 * 1024 * 1024))
        assert info.value.code == "INVALID_ARGUMENT"


def test_a_stream_without_a_header_first_is_refused(api: RunningApi) -> None:
    with api.client(user()) as rz:
        chunks = iter([trainer_pb2.CreateJobChunk(data=b"PK")])
        with pytest.raises(grpc.RpcError) as info:
            rz._stub.CreateJobStream(chunks, metadata=rz._md, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "first CreateJobStream message must carry `header`" in info.value.details()


def test_a_client_that_disconnects_mid_upload_leaves_no_job_and_no_object(
    api: RunningApi,
) -> None:
    sent_some = threading.Event()
    hang = threading.Event()

    def pieces() -> Iterator[trainer_pb2.CreateJobChunk]:
        header = trainer_pb2.CreateJobRequest(
            manifest_yaml=MANIFEST.format(name="gone"), idempotency_key="k-gone"
        )
        yield trainer_pb2.CreateJobChunk(header=header)
        for _ in range(4):
            yield trainer_pb2.CreateJobChunk(data=b"0" * 1024 * 1024)
        sent_some.set()
        hang.wait(30)  # the client stops sending, then goes away

    before = stored_models(api)
    name = user()
    with api.client(name) as rz:
        future = rz._stub.CreateJobStream.future(pieces(), metadata=rz._md, timeout=60)
        assert sent_some.wait(30)
        future.cancel()
        hang.set()
        with pytest.raises(grpc.FutureCancelledError):
            future.result()
    with api.client(name) as rz:
        assert list(rz.iter_jobs()) == []
    assert stored_models(api) == before


def test_a_message_over_grpcs_own_limit_is_explained_by_the_sdk(api: RunningApi) -> None:
    """Over 80 MiB gRPC refuses the message before the API sees it; the SDK (which never
    sends code that way itself) says what the limit is and how to send larger code."""
    request = trainer_pb2.CreateJobRequest(
        manifest_yaml=MANIFEST.format(name="huge"), model_definition=b"0" * (MESSAGE_LIMIT + 1)
    )
    with api.client(user(), timeout_s=60) as rz:
        with pytest.raises(ClientError) as info:
            rz._call("CreateJob", request)
        assert info.value.code == "RESOURCE_EXHAUSTED"
        assert "larger than the gRPC message limit" in info.value.message
        assert "Client.create_job" in info.value.message and "multipart" in info.value.message
        assert list(rz.iter_jobs()) == []
