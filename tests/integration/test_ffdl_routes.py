"""FfDL's routes we promise, through the real daemon (API alone) and MongoDB-wire server:
the model definition and trained-model downloads, job events (webhooks delivered to
receivers this test starts on 127.0.0.1), the loglines/emetrics aliases, and FfDL's job
names with spaces. REST and gRPC (the SDK) both."""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import logging
import queue
import threading
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.client.sdk import ClientError
from tests.integration.conftest import RunningApi

pytestmark = pytest.mark.integration

MANIFEST = b"name: parity\nframework:\n  command: python train.py\n"
FFDL_EXAMPLES = Path(__file__).resolve().parents[1] / "data" / "ffdl_examples"
WAIT_S = 30  # how long a delivery may take to arrive before the test fails (not a timing check)


def new_user() -> str:
    return f"f-{uuid.uuid4().hex[:8]}"


def code_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("train.py", "print('hi')\n")
    return buf.getvalue()


def submit(
    api: RunningApi, h: dict[str, str], manifest: bytes = MANIFEST, code: bool = True
) -> str:
    files: dict[str, Any] = {"manifest": ("manifest.yml", manifest)}
    if code:
        files["model_definition"] = ("model.zip", code_zip())
    resp = httpx.post(f"{api.rest}/v1/models", files=files, headers=h, timeout=10)
    assert resp.status_code == 201, resp.text
    return str(resp.json()["model_id"])


@dataclass
class Delivery:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """A webhook receiver on 127.0.0.1: answers `codes` in turn (then 200), or holds
    every request open until `release` is set when `hang`."""

    codes: list[int] = field(default_factory=list)
    hang: bool = False
    got: queue.Queue[Delivery] = field(default_factory=queue.Queue)
    release: threading.Event = field(default_factory=threading.Event)
    server: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def next(self) -> Delivery:
        try:
            return self.got.get(timeout=WAIT_S)
        except queue.Empty:
            raise AssertionError(f"no delivery reached {self.url} within {WAIT_S}s") from None


@pytest.fixture
def receiver() -> Iterator[Any]:
    started: list[Receiver] = []

    def start(codes: list[int] | None = None, hang: bool = False) -> Receiver:
        rec = Receiver(codes=list(codes or []), hang=hang)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                rec.got.put(Delivery(self.path, dict(self.headers), body))
                if rec.hang:
                    rec.release.wait(60)
                code = rec.codes.pop(0) if rec.codes else 200
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        rec.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=rec.server.serve_forever, daemon=True).start()
        started.append(rec)
        return rec

    yield start
    for rec in started:
        rec.release.set()
        rec.server.shutdown()
        rec.server.server_close()


def signature_ok(secret: str, delivery: Delivery) -> bool:
    expected = "sha256=" + hmac.new(secret.encode(), delivery.body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, delivery.headers.get("X-Rhizome-Signature", ""))


def halt(api: RunningApi, h: dict[str, str], job_id: str) -> dict[str, Any]:
    resp = httpx.patch(
        f"{api.rest}/v1/models/{job_id}", json={"status": "halt"}, headers=h, timeout=10
    )
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


# -- FfDL's job names ----------------------------------------------------------------------------
def test_an_ffdl_manifest_with_spaces_in_its_name_is_accepted_with_both_names(
    api: RunningApi,
) -> None:
    h = api.headers(new_user())
    manifest = (FFDL_EXAMPLES / "pytorch-launch-dist__manifest.yml").read_bytes()
    job_id = submit(api, h, manifest)
    job = httpx.get(f"{api.rest}/v1/models/{job_id}", headers=h, timeout=5).json()
    assert job["display_name"] == "pytorch ddl" and job["name"] == "pytorch-ddl"
    listed = httpx.get(
        f"{api.rest}/v1/models", params={"name_prefix": "pytorch-ddl"}, headers=h, timeout=5
    ).json()
    assert [m["model_id"] for m in listed["models"]] == [job_id]


# -- downloads -----------------------------------------------------------------------------------
def test_the_model_definition_downloads_as_submitted_by_rest_and_grpc(api: RunningApi) -> None:
    owner = new_user()
    h = api.headers(owner)
    job_id = submit(api, h)
    resp = httpx.get(f"{api.rest}/v1/models/{job_id}/definition", headers=h, timeout=10)
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/zip"
    assert zipfile.ZipFile(io.BytesIO(resp.content)).read("train.py") == b"print('hi')\n"
    with api.client(owner) as rz:
        out = io.BytesIO()
        rz.download_model_definition(job_id, out)
    assert out.getvalue() == resp.content
    other = httpx.get(
        f"{api.rest}/v1/models/{job_id}/definition", headers=api.headers(new_user()), timeout=10
    )
    assert other.status_code == 404


def test_a_job_without_code_has_no_definition_to_download(api: RunningApi) -> None:
    h = api.headers(new_user())
    job_id = submit(api, h, code=False)
    resp = httpx.get(f"{api.rest}/v1/models/{job_id}/definition", headers=h, timeout=10)
    assert resp.status_code == 404 and "without a model definition" in resp.json()["message"]


def test_the_trained_model_is_what_the_learners_stored_as_results(api: RunningApi) -> None:
    owner = new_user()
    h = api.headers(owner)
    job_id = submit(api, h)
    url = f"{api.rest}/v1/models/{job_id}/trained_model"
    early = httpx.get(url, headers=h, timeout=10)
    assert early.status_code == 404 and "no trained model yet" in early.json()["message"]
    # What a learner controller writes when its command succeeded (store_results):
    # <objects>/results/<job>/<rank>/..., the volume object store's layout.
    results = api.data_dir / "objects" / "results" / job_id
    (results / "0" / "ckpt").mkdir(parents=True)
    (results / "0" / "ckpt" / "model.pt").write_bytes(b"\x80weights")
    (results / "1").mkdir()
    (results / "1" / "metrics.json").write_text('{"acc": 0.9}')
    resp = httpx.get(url, headers=h, timeout=10)
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/zip"
    archive = zipfile.ZipFile(io.BytesIO(resp.content))
    assert sorted(archive.namelist()) == ["0/ckpt/model.pt", "1/metrics.json"]
    assert archive.read("0/ckpt/model.pt") == b"\x80weights"
    with api.client(owner) as rz:
        out = io.BytesIO()
        rz.download_trained_model(job_id, out)
    assert sorted(zipfile.ZipFile(out).namelist()) == ["0/ckpt/model.pt", "1/metrics.json"]
    with api.client(new_user()) as stranger, pytest.raises(ClientError) as info:
        stranger.download_trained_model(job_id, io.BytesIO())
    assert info.value.code == "NOT_FOUND"


# -- events --------------------------------------------------------------------------------------
def test_a_webhook_gets_each_status_change_signed_and_its_secret_is_shown_once(
    api: RunningApi, receiver: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Every log record at INFO, and the platform's own at DEBUG too. (pymongo's DEBUG
    # command log prints stored documents whole, as it would a job's data-store
    # credentials; the daemon never turns it on.)
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="rhizome")
    caplog.set_level(logging.DEBUG, logger="services")
    owner = new_user()
    h = api.headers(owner)
    job_id = submit(api, h)
    rec = receiver()
    created = httpx.post(
        f"{api.rest}/v1/models/{job_id}/events/status", json={"url": rec.url}, headers=h, timeout=10
    )
    assert created.status_code == 201, created.text
    secret = created.json()["secret"]
    endpoint = created.json()["endpoint"]
    assert secret and endpoint["event_type"] == "status" and endpoint["url"] == rec.url
    listed = httpx.get(f"{api.rest}/v1/models/{job_id}/events/status", headers=h, timeout=10)
    assert [e["endpoint_id"] for e in listed.json()["endpoints"]] == [endpoint["endpoint_id"]]
    assert secret not in listed.text
    one = httpx.get(
        f"{api.rest}/v1/models/{job_id}/events/status/{endpoint['endpoint_id']}",
        headers=h,
        timeout=10,
    )
    assert one.status_code == 200 and secret not in one.text

    halt(api, h, job_id)
    first = rec.next()
    event = json.loads(first.body)
    assert (event["job_id"], event["status"], event["previous_status"]) == (
        job_id,
        "HALTED",
        "QUEUED",
    )
    assert first.headers["X-Rhizome-Event"] == "status"
    assert signature_ok(secret, first)
    assert not signature_ok("another secret", first)
    resp = httpx.patch(
        f"{api.rest}/v1/models/{job_id}", json={"status": "resume"}, headers=h, timeout=10
    )
    assert resp.status_code == 200
    second = rec.next()
    assert json.loads(second.body)["status"] == "QUEUED" and signature_ok(secret, second)
    assert secret not in caplog.text


def test_a_failing_receiver_is_retried_until_it_accepts(api: RunningApi, receiver: Any) -> None:
    owner = new_user()
    job_id = submit(api, api.headers(owner))
    rec = receiver(codes=[500, 503])
    with api.client(owner) as rz:
        secret = rz.create_event_endpoint(job_id, "halted", rec.url).secret
        rz.halt_job(job_id)
    tries = [rec.next() for _ in range(3)]
    assert len({t.headers["X-Rhizome-Delivery"] for t in tries}) == 1  # the same event
    assert all(signature_ok(secret, t) for t in tries)
    assert json.loads(tries[-1].body)["status"] == "HALTED"


def test_a_hanging_receiver_holds_up_neither_the_job_nor_other_webhooks(
    api: RunningApi, receiver: Any
) -> None:
    owner = new_user()
    job_id = submit(api, api.headers(owner))
    stuck, healthy = receiver(hang=True), receiver()
    with api.client(owner) as rz:
        rz.create_event_endpoint(job_id, "status", stuck.url, endpoint_id="stuck")
        rz.create_event_endpoint(job_id, "status", healthy.url, endpoint_id="healthy")
        assert rz.halt_job(job_id).status == rz.get_job(job_id).status  # answered, HALTED
        stuck.next()  # its request is open, unanswered ...
        assert json.loads(healthy.next().body)["status"] == "HALTED"  # ... the other got its
        assert rz.resume_job(job_id).job_id == job_id
        assert json.loads(healthy.next().body)["status"] == "QUEUED"
        assert stuck.got.empty()  # still held on the first event: one delivery at a time
    stuck.release.set()


def test_webhooks_are_created_listed_and_deleted_by_grpc_only_by_their_owner(
    api: RunningApi, receiver: Any
) -> None:
    owner = new_user()
    job_id = submit(api, api.headers(owner))
    rec = receiver()
    with api.client(owner) as rz:
        made = rz.create_event_endpoint(job_id, "completed", rec.url, endpoint_id="mine")
        assert made.endpoint.endpoint_id == "mine" and made.secret
        with pytest.raises(ClientError) as twice:
            rz.create_event_endpoint(job_id, "completed", rec.url, endpoint_id="mine")
        assert twice.value.code == "FAILED_PRECONDITION"
        listed = rz.list_event_endpoints(job_id)
        assert [e.endpoint_id for e in listed] == ["mine"]
        assert "secret" not in str(listed)
    with api.client(new_user()) as stranger:
        for call in (
            lambda: stranger.create_event_endpoint(job_id, "status", rec.url),
            lambda: stranger.list_event_endpoints(job_id),
            lambda: stranger.delete_event_endpoint(job_id, "completed", "mine"),
        ):
            with pytest.raises(ClientError) as info:
                call()
            assert info.value.code == "NOT_FOUND"
    with api.client("an-admin", role="admin") as admin:
        assert [e.endpoint_id for e in admin.list_event_endpoints(job_id)] == ["mine"]
    with api.client(owner) as rz:
        assert rz.delete_event_endpoint(job_id, "completed", "mine").endpoint_id == "mine"
        assert rz.list_event_endpoints(job_id) == []
        with pytest.raises(ClientError) as gone:
            rz.delete_event_endpoint(job_id, "completed", "mine")
        assert gone.value.code == "NOT_FOUND"


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("file:///etc/passwd", "scheme 'file' is not allowed"),
        ("gopher://127.0.0.1:70/", "scheme 'gopher' is not allowed"),
        ("127.0.0.1:8080/hook", "is not allowed; use http:// or https://"),
        ("http:///nohost", "names no host"),
        ("http://user:pw@127.0.0.1/hook", "carries a user or password"),
        ("http://127.0.0.1:99999/hook", "is not a URL"),
    ],
)
def test_a_webhook_url_that_is_not_plain_http_is_refused(
    api: RunningApi, url: str, fragment: str
) -> None:
    h = api.headers(new_user())
    job_id = submit(api, h)
    resp = httpx.post(
        f"{api.rest}/v1/models/{job_id}/events/status", json={"url": url}, headers=h, timeout=10
    )
    assert resp.status_code == 400 and fragment in resp.json()["message"], resp.text


def test_an_unknown_event_type_is_refused_listing_the_known_ones(api: RunningApi) -> None:
    h = api.headers(new_user())
    job_id = submit(api, h)
    resp = httpx.post(
        f"{api.rest}/v1/models/{job_id}/events/exploded",
        json={"url": "http://127.0.0.1:1/x"},
        headers=h,
        timeout=10,
    )
    assert resp.status_code == 400
    assert "choose one of: status, " in resp.json()["message"]


# -- FfDL's paths of the log and metric streams ----------------------------------------------------
@pytest.mark.parametrize(
    ("ours", "ffdl"),
    [
        ("/v1/models/{id}/logs", "/v1/logs/{id}/loglines"),
        ("/v1/models/{id}/metrics", "/v1/logs/{id}/emetrics"),
    ],
)
def test_ffdl_stream_paths_answer_as_ours_do(api: RunningApi, ours: str, ffdl: str) -> None:
    owner, stranger = api.headers(new_user()), api.headers(new_user())
    job_id = submit(api, owner)
    for h in (owner, stranger):
        a = httpx.get(f"{api.rest}{ours.format(id=job_id)}", headers=h, timeout=10)
        b = httpx.get(f"{api.rest}{ffdl.format(id=job_id)}", headers=h, timeout=10)
        assert (a.status_code, a.json()) == (b.status_code, b.json())
        assert b.status_code != 404 or h is stranger
    bad = httpx.get(
        f"{api.rest}{ffdl.format(id=job_id)}", params={"since_time": "yesterday"}, headers=owner
    )
    assert bad.status_code == 400 and "since_time" in bad.json()["message"]


def test_the_openapi_document_lists_the_ffdl_routes(api: RunningApi) -> None:
    paths = httpx.get(f"{api.rest}/openapi.json", timeout=5).json()["paths"]
    for path in (
        "/v1/models/{model_id}/definition",
        "/v1/models/{model_id}/trained_model",
        "/v1/models/{model_id}/events/{event_type}",
        "/v1/models/{model_id}/events/{event_type}/{endpoint_id}",
        "/v1/logs/{model_id}/loglines",
        "/v1/logs/{model_id}/emetrics",
    ):
        assert path in paths, path
