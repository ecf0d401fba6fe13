"""POST /v1/models answers the same whichever way it is read: FastSubmit (a small body of
a declared length) or FastAPI's route (a chunked body, which FastSubmit leaves alone).

Each request below is sent both ways to one gateway over the real MongoDB-wire server,
and the two answers compared; the counts say which way each went."""

from __future__ import annotations

import io
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# starlette's TestClient is built on httpx2 (on httpx it warns that httpx is deprecated
# there): its answers are httpx2's, and the forms below are encoded by the same library.
import httpx2
import pytest
from starlette.testclient import TestClient

from services.api.auth import Authenticator
from services.api.core import TrainerCore
from services.api.fast_submit import FAST_SUBMIT_BYTES, FastSubmitCounts
from services.api.rest import build_app
from services.manifest import MAX_MANIFEST_BYTES
from services.store.jobs import JobsRepository
from services.store.mongo import connect
from services.store.objects import LocalObjectStore

MANIFEST = b"name: fast\nlearners: 1\nframework:\n  command: python train.py\n"
# What differs between two stored jobs of the same request.
PER_JOB = {"job_id", "model_id", "created_at", "updated_at", "history"}


def code_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("train.py", "print('hi')\n")
    return buf.getvalue()


@pytest.fixture
def gateway(mongo_server: Any, tmp_path: Path) -> Iterator[tuple[TestClient, FastSubmitCounts]]:
    jobs = JobsRepository(connect(mongo_server.url))
    jobs.ensure_indexes()
    core = TrainerCore(jobs, LocalObjectStore(tmp_path))
    # Whoever the header names: these tests are about the form, not the credential.
    app = build_app(core, auth=Authenticator(None, trust_user_header=True))
    with TestClient(app) as client:
        yield client, app.state.fast_submits


def encoded(
    files: list[tuple[str, tuple[str, bytes]]] | None = None,
    data: dict[str, str] | None = None,
    raw: tuple[bytes, str] | None = None,
) -> tuple[bytes, str]:
    """The body and content type of a form as httpx2 encodes it (or `raw` as it is)."""
    if raw is not None:
        return raw
    request = httpx2.Request("POST", "http://x/v1/models", files=files, data=data)
    return request.read(), request.headers["content-type"]


def both_ways(
    client: TestClient, body: bytes, content_type: str, user: str = ""
) -> tuple[httpx2.Response, httpx2.Response]:
    """The same request with a declared length (FastSubmit may answer) and chunked
    (FastAPI's route answers), from `user` or else each from a user of its own (one's
    job is not the other's idempotent retry)."""

    def headers() -> dict[str, str]:
        who = user or f"u-{uuid.uuid4().hex[:6]}"
        return {"X-Rhizome-User": who, "content-type": content_type}

    fast = client.post("/v1/models", content=body, headers=headers())
    routed = client.post("/v1/models", content=iter([body]), headers=headers())
    return fast, routed


def same_answer(fast: httpx2.Response, routed: httpx2.Response) -> None:
    assert fast.status_code == routed.status_code, (fast.text, routed.text)
    assert fast.headers.get("content-type") == routed.headers.get("content-type")
    assert fast.headers.get("retry-after") == routed.headers.get("retry-after")
    a, b = fast.json(), routed.json()
    if fast.status_code in (200, 201):
        assert a["owner"] != b["owner"]
        a.pop("owner"), b.pop("owner")
        assert a["job_id"] != b["job_id"]
        a, b = ({k: v for k, v in x.items() if k not in PER_JOB} for x in (a, b))
    assert a == b


SUBMITS = {
    "manifest": ([("manifest", ("manifest.yml", MANIFEST))], None),
    "manifest and code": (
        [("manifest", ("manifest.yml", MANIFEST)), ("model_definition", ("m.zip", code_zip()))],
        None,
    ),
    "an empty code part": (
        [("manifest", ("manifest.yml", MANIFEST)), ("model_definition", ("m.zip", b""))],
        None,
    ),
    "an unknown extra field": ([("manifest", ("manifest.yml", MANIFEST))], {"other": "x"}),
}


@pytest.mark.parametrize("name", list(SUBMITS))
def test_a_submit_of_the_documented_form_is_answered_by_fast_submit(
    gateway: tuple[TestClient, FastSubmitCounts], name: str
) -> None:
    client, counts = gateway
    files, data = SUBMITS[name]
    fast, routed = both_ways(client, *encoded(files, data))
    assert fast.status_code == 201, fast.text
    same_answer(fast, routed)
    assert (counts.answered, counts.handed_on) == (1, 0)  # the chunked one went to the route


REFUSED = {
    "a bad manifest": ([("manifest", ("m.yml", b"name: [unclosed\n"))], None),
    "an invalid manifest": ([("manifest", ("m.yml", b"name: x\n"))], None),
    "a manifest over its limit": (
        [("manifest", ("m.yml", MANIFEST + b"#" * MAX_MANIFEST_BYTES))],
        None,
    ),
    "code that is not a zip": (
        [("manifest", ("m.yml", MANIFEST)), ("model_definition", ("m.zip", b"not a zip"))],
        None,
    ),
    "an idempotency key over its limit": (
        [("manifest", ("m.yml", MANIFEST))],
        {"idempotency_key": "k" * 129},
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_refused_submit_gets_the_routes_error(
    gateway: tuple[TestClient, FastSubmitCounts], name: str
) -> None:
    client, counts = gateway
    files, data = REFUSED[name]
    body, content_type = encoded(files, data)
    assert len(body) <= FAST_SUBMIT_BYTES
    fast, routed = both_ways(client, body, content_type)
    assert fast.status_code in (400, 413), fast.text
    same_answer(fast, routed)
    assert (counts.answered, counts.handed_on) == (1, 0)


HANDED_ON = {
    "no manifest": ([], {"idempotency_key": "k"}, None),
    "a manifest that is a field, not a file": ([], {"manifest": MANIFEST.decode()}, None),
    "two manifests": (
        [("manifest", ("a.yml", MANIFEST)), ("manifest", ("b.yml", MANIFEST))],
        None,
        None,
    ),
    "code that is a field": ([("manifest", ("m.yml", MANIFEST))], {"model_definition": "x"}, None),
    "a key that is a file": (
        [("manifest", ("m.yml", MANIFEST)), ("idempotency_key", ("k.txt", b"k"))],
        None,
        None,
    ),
    "two keys": ([("manifest", ("m.yml", MANIFEST))], {"idempotency_key": ["a", "b"]}, None),
    "a JSON body": (None, None, (b'{"manifest": "name: x"}', "application/json")),
    "no content type": (None, None, (MANIFEST, "")),
    "a broken multipart body": (
        None,
        None,
        (b"--b\r\nContent-Disposition: form-data\r\n\r\nx", "multipart/form-data; boundary=b"),
    ),
    "a multipart body without a boundary": (None, None, (b"x", "multipart/form-data")),
}


@pytest.mark.parametrize("name", list(HANDED_ON))
def test_any_other_form_is_answered_by_fastapis_route(
    gateway: tuple[TestClient, FastSubmitCounts], name: str
) -> None:
    client, counts = gateway
    files, data, raw = HANDED_ON[name]
    fast, routed = both_ways(client, *encoded(files, data, raw))  # type: ignore[arg-type]
    same_answer(fast, routed)
    assert (counts.answered, counts.handed_on) == (0, 1)


def test_an_idempotent_retry_is_the_same_job_either_way(
    gateway: tuple[TestClient, FastSubmitCounts],
) -> None:
    client, counts = gateway
    user = f"u-{uuid.uuid4().hex[:6]}"
    body, content_type = encoded([("manifest", ("m.yml", MANIFEST))], {"idempotency_key": "k1"})
    headers = {"X-Rhizome-User": user, "content-type": content_type}
    first = client.post("/v1/models", content=body, headers=headers)
    again, routed = both_ways(client, body, content_type, user)
    assert first.status_code == 201 and first.json()["existing"] is False
    assert again.status_code == routed.status_code == 200
    assert again.json()["job_id"] == routed.json()["job_id"] == first.json()["job_id"]
    # The header names the key when the form does not.
    body, content_type = encoded([("manifest", ("m.yml", MANIFEST))])
    headers = {"X-Rhizome-User": user, "content-type": content_type, "Idempotency-Key": "k1"}
    by_header = client.post("/v1/models", content=body, headers=headers)
    assert by_header.status_code == 200 and by_header.json()["job_id"] == first.json()["job_id"]
    # Another manifest under the same key is refused the same way by both.
    body, content_type = encoded(
        [("manifest", ("m.yml", MANIFEST + b"description: other\n"))], {"idempotency_key": "k1"}
    )
    fast, routed = both_ways(client, body, content_type, user)
    assert fast.status_code == 409
    same_answer(fast, routed)
    assert (counts.answered, counts.handed_on) == (4, 0)


def test_a_large_upload_and_a_caller_without_credentials_skip_fast_submit(
    gateway: tuple[TestClient, FastSubmitCounts],
) -> None:
    client, counts = gateway
    big = code_zip() + b"\0" * FAST_SUBMIT_BYTES  # not a zip either: refused by the core
    body, content_type = encoded(
        [("manifest", ("m.yml", MANIFEST)), ("model_definition", ("m.zip", big))]
    )
    fast, routed = both_ways(client, body, content_type)
    same_answer(fast, routed)
    anonymous = client.post("/v1/models", content=body, headers={"content-type": content_type})
    assert anonymous.status_code == 401
    assert (counts.answered, counts.handed_on) == (0, 0)
