"""The REST gateway: FfDL routes, OpenAPI, JSON errors with the right status codes."""

from __future__ import annotations

import http.client
import io
import json
import socket
import uuid
import zipfile
from urllib.parse import urlparse

import httpx
import pytest

from services.api.core import MAX_MODEL_BYTES
from services.manifest import MAX_MANIFEST_BYTES
from tests.integration.conftest import RunningApi

pytestmark = pytest.mark.integration

MANIFEST = b"name: rest-job\nlearners: 1\nframework:\n  command: python train.py\n"


def new_user() -> str:
    return f"r-{uuid.uuid4().hex[:8]}"


def code_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("train.py", "print('hi')\n")
    return buf.getvalue()


def submit(api: RunningApi, h: dict[str, str], manifest: bytes = MANIFEST) -> httpx.Response:
    files = {"manifest": ("manifest.yml", manifest), "model_definition": ("model.zip", code_zip())}
    return httpx.post(f"{api.rest}/v1/models", files=files, headers=h, timeout=10)


def test_openapi_document_lists_the_ffdl_routes(api: RunningApi) -> None:
    spec = httpx.get(f"{api.rest}/openapi.json", timeout=5).json()
    assert spec["openapi"].startswith("3.")
    for path in (
        "/v1/models",
        "/v1/models/{model_id}",
        "/v1/models/{model_id}/logs",
        "/v1/models/{model_id}/metrics",
    ):
        assert path in spec["paths"], path
    assert {"get", "patch", "delete"} <= set(spec["paths"]["/v1/models/{model_id}"])


def test_openapi_document_says_what_is_sent(api: RunningApi) -> None:
    """The log and metric streams are NDJSON, their errors JSON; a bad request is a 400
    `ErrorBody`, never the 422 FastAPI documents by default (found by schemathesis)."""
    spec = httpx.get(f"{api.rest}/openapi.json", timeout=5).json()
    for path in ("/v1/models/{model_id}/logs", "/v1/models/{model_id}/metrics"):
        responses = spec["paths"][path]["get"]["responses"]
        assert list(responses["200"]["content"]) == ["application/x-ndjson"]
        assert list(responses["404"]["content"]) == ["application/json"]
    for path_item in spec["paths"].values():
        for operation in path_item.values():
            assert "422" not in operation["responses"]
    assert "HTTPValidationError" not in spec["components"]["schemas"]


def test_post_get_list_patch_delete(api: RunningApi) -> None:
    h = api.headers(new_user())
    created = submit(api, h)
    assert created.status_code == 201, created.text
    job_id = created.json()["model_id"]
    got = httpx.get(f"{api.rest}/v1/models/{job_id}", headers=h, timeout=5).json()
    assert got["status"] == "QUEUED" and got["name"] == "rest-job"
    listed = httpx.get(f"{api.rest}/v1/models", headers=h, timeout=5).json()
    assert [m["model_id"] for m in listed["models"]] == [job_id]
    halted = httpx.patch(
        f"{api.rest}/v1/models/{job_id}", json={"status": "halt"}, headers=h, timeout=5
    )
    assert halted.json()["status"] == "HALTED"
    bad = httpx.patch(
        f"{api.rest}/v1/models/{job_id}", json={"status": "explode"}, headers=h, timeout=5
    )
    assert bad.status_code == 400 and "halt" in bad.json()["message"]
    deleted = httpx.delete(f"{api.rest}/v1/models/{job_id}", headers=h, timeout=5)
    assert deleted.json()["status"] == "DELETED"


def test_errors_are_json_with_the_right_status(api: RunningApi) -> None:
    h = api.headers(new_user())
    bad = submit(api, h, manifest=b"name: x\nframework: {command: c}\ncpus: -1\n")
    assert bad.status_code == 400
    assert bad.json()["code"] == "bad_request" and "cpus" in bad.json()["message"]
    missing = httpx.get(f"{api.rest}/v1/models/job-unknown", headers=h, timeout=5)
    assert missing.status_code == 404 and missing.json()["code"] == "not_found"
    anon = httpx.get(f"{api.rest}/v1/models", timeout=5)
    assert anon.status_code == 401 and "Authorization: Bearer" in anon.json()["message"]


def test_idempotency_key_and_conflict(api: RunningApi) -> None:
    h = {**api.headers(new_user()), "Idempotency-Key": "same"}
    a = submit(api, h)
    b = submit(api, h)
    assert a.status_code == 201 and b.status_code == 200
    assert a.json()["model_id"] == b.json()["model_id"] and b.json()["existing"]
    c = submit(api, h, manifest=MANIFEST.replace(b"rest-job", b"another"))
    assert c.status_code == 409 and c.json()["code"] == "conflict"


def test_an_oversized_upload_is_413_and_stores_nothing(api: RunningApi) -> None:
    """A body announced over the limit is refused before it is read, naming the limit
    (sending the 512 MiB itself would only make the test slow)."""
    h = api.headers(new_user())
    url = urlparse(api.rest)
    announced = MAX_MODEL_BYTES + MAX_MANIFEST_BYTES + 64 * 1024 + 1
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
    try:
        conn.putrequest("POST", "/v1/models")
        conn.putheader("Authorization", h["Authorization"])
        conn.putheader("Content-Type", "multipart/form-data; boundary=b")
        conn.putheader("Content-Length", str(announced))
        conn.endheaders()  # and no body: the answer comes first
        resp = conn.getresponse()
        body = json.loads(resp.read())
    finally:
        conn.close()
    assert resp.status == 413 and body["code"] == "too_large"
    assert f"at most {announced - 1}" in body["message"]
    assert httpx.get(f"{api.rest}/v1/models", headers=h, timeout=5).json()["models"] == []


def test_a_connection_dropped_mid_upload_leaves_no_record(api: RunningApi) -> None:
    h = api.headers(new_user())
    url = urlparse(api.rest)
    boundary = "XyZ"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="manifest"; filename="m.yml"\r\n\r\n'
        ).encode()
        + MANIFEST
        + f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="model_definition"; filename="m.zip"\r\n\r\n'.encode()
    )
    head = (
        f"POST /v1/models HTTP/1.1\r\nHost: {url.hostname}\r\nAuthorization: {h['Authorization']}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {len(body) + 100_000}\r\n\r\n"
    ).encode()
    with socket.create_connection((url.hostname, url.port), timeout=5) as sock:
        sock.sendall(head + body + b"x" * 1000)  # then hang up long before the promised length
    listed = httpx.get(f"{api.rest}/v1/models", headers=h, timeout=5).json()
    assert listed["models"] == []


def _zip_of(*members: tuple[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members:
            zf.writestr(name, data)
    return buf.getvalue()


def test_routing_errors_have_the_same_body_and_405_says_what_is_allowed(api: RunningApi) -> None:
    h = api.headers(new_user())
    nowhere = httpx.get(f"{api.rest}/v1/nowhere", headers=h, timeout=5)
    assert nowhere.status_code == 404
    assert set(nowhere.json()) == {"code", "message"} and nowhere.json()["code"] == "not_found"
    wrong = httpx.put(f"{api.rest}/v1/models", headers=h, timeout=5)
    assert wrong.status_code == 405 and wrong.json()["code"] == "method_not_allowed"
    assert set(wrong.headers["allow"].replace(" ", "").split(",")) == {"GET", "POST"}


@pytest.mark.parametrize(
    ("path", "param"),
    [
        ("/v1/models?page_size=0", "page_size"),
        ("/v1/models?page_size=99999999999999999999999", "page_size"),
        ("/v1/models/job-x/logs?pos=9223372036854775808", "pos"),
        ("/v1/models/job-x/logs?learner=-2", "learner"),
        ("/v1/models/job-x/metrics?pagesize=-1", "pagesize"),
    ],
)
def test_out_of_range_query_parameters_are_400_naming_them(
    api: RunningApi, path: str, param: str
) -> None:
    r = httpx.get(f"{api.rest}{path}", headers=api.headers(new_user()), timeout=5)
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "bad_request" and param in r.json()["message"]


def test_hostile_archives_are_refused_and_store_nothing(api: RunningApi) -> None:
    h = api.headers(new_user())
    cases = [
        (_zip_of(("zeros.bin", b"\0" * (20 * 1024 * 1024))), 413, "zip bomb"),
        (_zip_of(), 400, "empty"),
        (_zip_of(("../../etc/cron.d/x", b"x")), 400, "'..'"),
    ]
    for archive, status, fragment in cases:
        files = {"manifest": ("manifest.yml", MANIFEST), "model_definition": ("m.zip", archive)}
        r = httpx.post(f"{api.rest}/v1/models", files=files, headers=h, timeout=30)
        assert r.status_code == status, r.text
        assert fragment in r.json()["message"]
    listed = httpx.get(f"{api.rest}/v1/models", headers=h, timeout=5).json()
    assert listed["models"] == []


def test_a_non_utf8_manifest_is_a_clear_400(api: RunningApi) -> None:
    r = submit(api, api.headers(new_user()), manifest=b"name: \xff\xfe\nframework: {command: c}\n")
    assert r.status_code == 400
    assert "not UTF-8" in r.json()["message"]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("PATCH", "/v1/models/job-x", b"{{{"),
        ("POST", "/v1/models/job-x/scale", b'{"learners": "many"}'),
        ("POST", "/v1/tokens", b"\xff\xfe"),
        ("GET", "/v1/models?page_size=-5", b""),
        ("PUT", "/v1/models", b""),
    ],
)
def test_without_a_token_a_bad_request_is_401_before_the_body_is_read(
    api: RunningApi, method: str, path: str, body: bytes
) -> None:
    """Found by fuzzing with no token: a malformed body or parameter was a 400 (the
    request was validated before the caller was known)."""
    r = httpx.request(
        method,
        f"{api.rest}{path}",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=5,
    )
    assert r.status_code == 401, r.text
    assert r.json()["code"] == "unauthenticated"


def test_a_request_the_http_parser_refuses_is_a_json_400_saying_what_to_fix(
    api: RunningApi,
) -> None:
    url = urlparse(api.rest)
    request = (
        f"GET /v1/models HTTP/1.1\r\nHost: {url.hostname}\r\n"
        "Authorization: Bearer \x7f-a-control-character\r\n\r\n"
    ).encode()
    with socket.create_connection((url.hostname, url.port), timeout=5) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:300]
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)
    assert error["code"] == "bad_request"
    assert "control character" in error["message"]
    # the gateway goes on serving
    assert httpx.get(f"{api.rest}/healthz", timeout=5).status_code == 200
