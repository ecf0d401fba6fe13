"""Authentication and roles against the real servers: bearer tokens on gRPC and REST,
revoke and expiry, users confined to their own jobs, admins over all of them, token
management, and the FfDL user header only with --insecure-trust-user-header."""

from __future__ import annotations

import logging
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from rhizome.v1 import job_pb2, trainer_pb2, trainer_pb2_grpc

from services.api.auth import ensure_admin_token_file
from services.client.sdk import Client, ClientError
from services.embedded.process import ManagedServer
from tests.integration.conftest import RunningApi, start_api

pytestmark = pytest.mark.integration

MANIFEST = "name: {name}\nlearners: 1\nframework:\n  command: python train.py\n"
CACHE_S = 1.0


def user() -> str:
    return f"a-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def api(
    mongo_server: ManagedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningApi]:
    """The API with a short authentication cache, so revokes show within the test."""
    running = start_api(
        mongo_server.url, Path(tmp_path_factory.mktemp("auth")), auth_cache_s=CACHE_S
    )
    try:
        yield running
    finally:
        running.daemon.stop()


@pytest.fixture(scope="module")
def insecure_api(
    mongo_server: ManagedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningApi]:
    running = start_api(
        mongo_server.url, Path(tmp_path_factory.mktemp("insecure")), trust_user_header=True
    )
    try:
        yield running
    finally:
        running.daemon.stop()


def raw_stub(api: RunningApi) -> tuple[grpc.Channel, trainer_pb2_grpc.TrainerStub]:
    channel = grpc.insecure_channel(api.grpc)
    return channel, trainer_pb2_grpc.TrainerStub(channel)


def grpc_code(call: object) -> grpc.StatusCode:
    assert isinstance(call, grpc.RpcError)
    code: grpc.StatusCode = call.code()
    return code


# -- who may call ---------------------------------------------------------------------------
def test_a_call_without_a_token_is_unauthenticated_and_says_how_to_get_one(
    api: RunningApi,
) -> None:
    channel, stub = raw_stub(api)
    try:
        for method, request in [
            (stub.ListJobs, trainer_pb2.ListJobsRequest()),
            (stub.CreateJob, trainer_pb2.CreateJobRequest(manifest_yaml=MANIFEST.format(name="x"))),
            (stub.GetJob, trainer_pb2.GetJobRequest(job_id="job-x")),
            (stub.ListTokens, trainer_pb2.ListTokensRequest()),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                method(request, timeout=5)
            assert grpc_code(info.value) == grpc.StatusCode.UNAUTHENTICATED
            assert "rhizome token create" in info.value.details()
        # Version, health and reflection stay public.
        assert stub.GetVersion(trainer_pb2.GetVersionRequest(), timeout=5).api == "rhizome.v1"
    finally:
        channel.close()
    for verb, path in [("GET", "/v1/models"), ("GET", "/v1/models/job-x"), ("GET", "/v1/tokens")]:
        r = httpx.request(verb, f"{api.rest}{path}", timeout=5)
        assert r.status_code == 401, r.text
        body = r.json()
        assert body["code"] == "unauthenticated" and "Authorization: Bearer" in body["message"]
    upload = httpx.post(
        f"{api.rest}/v1/models",
        files={"manifest": ("manifest.yml", MANIFEST.format(name="x").encode())},
        timeout=5,
    )
    assert upload.status_code == 401 and upload.json()["code"] == "unauthenticated"
    assert httpx.get(f"{api.rest}/v1/version", timeout=5).status_code == 200


def test_a_wrong_or_malformed_token_is_refused(api: RunningApi) -> None:
    with (
        Client(api.grpc, token="rz_" + "A" * 43) as wrong,
        pytest.raises(ClientError) as info,
    ):
        wrong.list_jobs()
    assert info.value.code == "UNAUTHENTICATED" and "unknown token" in info.value.message
    for value in ["Bearer rz_nope", "Basic dXNlcjpwYXNz", "Bearer", "rz_abc"]:
        r = httpx.get(f"{api.rest}/v1/models", headers={"Authorization": value}, timeout=5)
        assert r.status_code == 401, (value, r.text)
        assert r.json()["code"] == "unauthenticated"


def test_the_user_header_alone_is_ignored_without_the_insecure_flag(api: RunningApi) -> None:
    who = user()
    r = httpx.get(f"{api.rest}/v1/models", headers={"X-Rhizome-User": who}, timeout=5)
    assert r.status_code == 401
    r = httpx.get(
        f"{api.rest}/v1/models",
        headers={"X-Watson-Userinfo": f"bluemix-instance-id={who}"},
        timeout=5,
    )
    assert r.status_code == 401
    with Client(api.grpc, user=who, token="") as rz, pytest.raises(ClientError) as info:
        rz.list_jobs()
    assert info.value.code == "UNAUTHENTICATED"


def test_the_user_header_is_honoured_with_the_insecure_flag(
    insecure_api: RunningApi,
) -> None:
    who = user()
    with Client(insecure_api.grpc, user=who, token="") as rz:
        job = rz.create_job(MANIFEST.format(name="ffdl")).job_id
        assert rz.get_job(job).owner == who
    h = {"X-Watson-Userinfo": f"bluemix-instance-id={who}"}
    listed = httpx.get(f"{insecure_api.rest}/v1/models", headers=h, timeout=5).json()
    assert [m["model_id"] for m in listed["models"]] == [job]
    listed = httpx.get(
        f"{insecure_api.rest}/v1/models", headers={"X-Rhizome-User": who}, timeout=5
    ).json()
    assert [m["model_id"] for m in listed["models"]] == [job]
    # A token still wins over the header: its user, not the header's.
    other = user()
    both = {**insecure_api.headers(other), "X-Rhizome-User": who}
    assert httpx.get(f"{insecure_api.rest}/v1/models", headers=both, timeout=5).json() == {
        "models": [],
        "next_page_token": "",
    }
    # Without either, still 401.
    assert httpx.get(f"{insecure_api.rest}/v1/models", timeout=5).status_code == 401


def test_the_insecure_flag_is_logged_as_a_warning_at_start(
    mongo_server: ManagedServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="rhizome.api"):
        running = start_api(mongo_server.url, tmp_path, trust_user_header=True)
        running.daemon.stop()
    warnings = [r for r in caplog.records if "insecure-trust-user-header" in r.getMessage()]
    assert warnings and warnings[0].levelno == logging.WARNING


# -- revoke and expiry ------------------------------------------------------------------------
def test_a_token_revoked_through_the_api_stops_at_once(api: RunningApi) -> None:
    who = user()
    with api.client("root", "admin") as admin:
        created = admin.create_token(user=who)
        with Client(api.grpc, token=created.secret) as rz:
            rz.list_jobs()  # works, and is now cached
            admin.revoke_token(created.token.token_id)
            with pytest.raises(ClientError) as info:
                rz.list_jobs()
    assert info.value.code == "UNAUTHENTICATED" and "revoked" in info.value.message


def test_a_token_revoked_elsewhere_stops_within_the_cache_bound(api: RunningApi) -> None:
    """Revoked in the store (as another daemon would): this daemon's cache may still
    accept it, but for no longer than --auth-cache-seconds."""
    created = api.tokens.create(user())
    h = {"Authorization": f"Bearer {created.secret}"}
    assert httpx.get(f"{api.rest}/v1/models", headers=h, timeout=5).status_code == 200
    api.tokens.revoke(created.record.token_id)
    revoked_at = time.monotonic()
    while httpx.get(f"{api.rest}/v1/models", headers=h, timeout=5).status_code == 200:
        assert time.monotonic() - revoked_at < CACHE_S + 1.0, "the revoke outlived the cache bound"
        time.sleep(0.05)
    r = httpx.get(f"{api.rest}/v1/models", headers=h, timeout=5)
    assert r.status_code == 401 and "revoked" in r.json()["message"]


def test_an_expired_token_is_refused(api: RunningApi) -> None:
    created = api.tokens.create(user(), expires_at=time.time() + 1.0)
    with Client(api.grpc, token=created.secret) as rz:
        rz.list_jobs()  # valid, and cached
        time.sleep(1.2)
        with pytest.raises(ClientError) as info:
            rz.list_jobs()  # refused even though the lookup is still cached
    assert info.value.code == "UNAUTHENTICATED" and "expired" in info.value.message


# -- users and admins --------------------------------------------------------------------------
def test_another_users_token_gets_404_on_their_jobs(api: RunningApi) -> None:
    alice, bob = user(), user()
    with api.client(alice) as a, api.client(bob) as b:
        job = a.create_job(MANIFEST.format(name="alices")).job_id
        for call in (b.get_job, b.halt_job, b.resume_job, b.delete_job):
            with pytest.raises(ClientError) as info:
                call(job)
            assert info.value.code == "NOT_FOUND"
        assert list(b.iter_jobs()) == []
        assert a.get_job(job).status == job_pb2.QUEUED
    for verb, path, body in [
        ("GET", f"/v1/models/{job}", None),
        ("PATCH", f"/v1/models/{job}", {"status": "halt"}),
        ("DELETE", f"/v1/models/{job}", None),
        ("GET", f"/v1/models/{job}/logs", None),
    ]:
        r = httpx.request(verb, f"{api.rest}{path}", json=body, headers=api.headers(bob), timeout=5)
        assert r.status_code == 404 and r.json()["code"] == "not_found", (verb, path, r.text)


def test_an_admin_sees_and_controls_every_job(api: RunningApi) -> None:
    alice, bob = user(), user()
    with api.client(alice) as a, api.client(bob) as b, api.client("ops", "admin") as admin:
        ja = a.create_job(MANIFEST.format(name="a-job")).job_id
        jb = b.create_job(MANIFEST.format(name="b-job")).job_id
        listed = {j.job_id: j.owner for j in admin.iter_jobs()}
        assert listed[ja] == alice and listed[jb] == bob
        assert admin.get_job(jb).owner == bob
        assert admin.halt_job(jb).status == job_pb2.HALTED
        assert admin.resume_job(jb).status == job_pb2.QUEUED
        assert admin.delete_job(ja).status == job_pb2.DELETED
        assert a.get_job(ja).status == job_pb2.DELETED
        # An admin's own submit is owned by the admin.
        assert admin.get_job(admin.create_job(MANIFEST.format(name="mine")).job_id).owner == "ops"
    r = httpx.get(f"{api.rest}/v1/models", headers=api.headers("ops", "admin"), timeout=5)
    owners = {m["owner"] for m in r.json()["models"]}
    assert {alice, bob, "ops"} <= owners


# -- token management --------------------------------------------------------------------------
def test_only_admins_manage_tokens_and_secrets_are_shown_once(api: RunningApi) -> None:
    with api.client(user()) as plain, pytest.raises(ClientError) as info:
        plain.create_token(user="someone")
    assert info.value.code == "PERMISSION_DENIED"
    who = user()
    with api.client("root", "admin") as admin:
        created = admin.create_token(user=who, role="user", expires_in_s=3600, description="ci")
        assert created.secret.startswith("rz_")
        assert created.token.user == who and created.token.created_by == "root"
        assert created.token.HasField("expires_at") and not created.token.HasField("revoked_at")
        listed = admin.list_tokens()
        mine = [t for t in listed if t.token_id == created.token.token_id]
        assert len(mine) == 1 and created.secret not in str(listed)
        with pytest.raises(ClientError) as info:
            admin.create_token(user=who, role="superuser")
        assert info.value.code == "INVALID_ARGUMENT"
        with pytest.raises(ClientError) as info:
            admin.revoke_token("tok_missing")
        assert info.value.code == "NOT_FOUND"
    with Client(api.grpc, token=created.secret) as rz:
        assert list(rz.iter_jobs()) == []


def test_tokens_over_rest(api: RunningApi) -> None:
    admin = api.headers("root", "admin")
    who = user()
    r = httpx.post(f"{api.rest}/v1/tokens", json={"user": who}, headers=admin, timeout=5)
    assert r.status_code == 201, r.text
    secret, token_id = r.json()["secret"], r.json()["token"]["token_id"]
    listed = httpx.get(f"{api.rest}/v1/tokens", headers=admin, timeout=5)
    assert token_id in listed.text and secret not in listed.text
    mine = {"Authorization": f"Bearer {secret}"}
    assert httpx.get(f"{api.rest}/v1/models", headers=mine, timeout=5).status_code == 200
    denied = httpx.get(f"{api.rest}/v1/tokens", headers=mine, timeout=5)
    assert denied.status_code == 403 and denied.json()["code"] == "permission_denied"
    revoked = httpx.delete(f"{api.rest}/v1/tokens/{token_id}", headers=admin, timeout=5)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    assert httpx.get(f"{api.rest}/v1/models", headers=mine, timeout=5).status_code == 401
    spec = httpx.get(f"{api.rest}/openapi.json", timeout=5).json()
    assert "HTTPBearer" in spec["components"]["securitySchemes"]


# -- the bootstrap admin token -------------------------------------------------------------------
def test_the_admin_token_file_is_created_once_with_mode_0600(
    api: RunningApi, tmp_path: Path
) -> None:
    path = tmp_path / "admin.token"
    first = ensure_admin_token_file(api.tokens, path, user="owner")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = path.read_text().strip()
    record = api.tokens.authenticate(secret)
    assert (record.token_id, record.user, record.role) == (first, "owner", "admin")
    assert ensure_admin_token_file(api.tokens, path) == first  # kept on a restart
    path.write_text("rz_" + "B" * 43)  # a token from another store
    replaced = ensure_admin_token_file(api.tokens, path, user="owner")
    assert replaced != first and stat.S_IMODE(path.stat().st_mode) == 0o600
