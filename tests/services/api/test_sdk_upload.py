"""The SDK's upload path without a server: code goes in pieces through CreateJobStream,
and to a daemon from before that call (UNIMPLEMENTED) in one CreateJob message when it
fits. A fake stub stands in for the daemon (unit test)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from rhizome.v1 import trainer_pb2

from services.client import sdk
from services.client.sdk import Client, ClientError


class Unimplemented(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNIMPLEMENTED

    def details(self) -> str:
        return "Method not found!"


class FakeStub:
    def __init__(self, streaming: bool) -> None:
        self.streaming = streaming
        self.pieces: list[trainer_pb2.CreateJobChunk] = []
        self.unary: list[trainer_pb2.CreateJobRequest] = []

    def CreateJobStream(self, it: Any, **_: Any) -> trainer_pb2.CreateJobResponse:
        if not self.streaming:
            raise Unimplemented()
        self.pieces = list(it)
        return trainer_pb2.CreateJobResponse(job_id="job-s")

    def CreateJob(self, req: Any, **_: Any) -> trainer_pb2.CreateJobResponse:
        self.unary.append(req)
        return trainer_pb2.CreateJobResponse(job_id="job-u")


def client(stub: FakeStub) -> Client:
    rz = Client("127.0.0.1:1", token="rz_test", tls=False)
    rz._stub = stub  # type: ignore[assignment]
    return rz


def test_code_goes_in_pieces_after_a_header(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sdk, "UPLOAD_CHUNK", 4)
    stub = FakeStub(streaming=True)
    seen: list[tuple[int, int]] = []
    with client(stub) as rz:
        resp = rz.create_job(
            "name: x", b"0123456789", "key", progress=lambda s, t: seen.append((s, t))
        )
    assert resp.job_id == "job-s"
    assert stub.pieces[0].header.manifest_yaml == "name: x"
    assert stub.pieces[0].header.idempotency_key == "key"
    assert not stub.pieces[0].header.model_definition
    assert b"".join(p.data for p in stub.pieces[1:]) == b"0123456789"
    assert seen == [(4, 10), (8, 10), (10, 10)]


def test_an_older_daemon_gets_small_code_in_one_message() -> None:
    stub = FakeStub(streaming=False)
    with client(stub) as rz:
        assert rz.create_job("name: x", b"zip").job_id == "job-u"
    assert stub.unary[0].model_definition == b"zip"


def test_an_older_daemon_and_code_over_one_message_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sdk, "MAX_UNARY_CODE", 2)
    stub = FakeStub(streaming=False)
    with client(stub) as rz, pytest.raises(ClientError) as info:
        rz.create_job("name: x", b"zip")
    assert info.value.code == "UNIMPLEMENTED" and stub.unary == []
    assert "older than this client: upgrade the platform" in info.value.message
