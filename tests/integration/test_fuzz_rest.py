"""schemathesis against the REST gateway's own `/openapi.json`, served by a real daemon.

Every operation in the document gets a bounded number of generated requests (valid ones
and, in a second mode, ones that break the schema on purpose), sent with a real bearer
token, then again with no token, a wrong one and a malformed `Authorization`. What must
hold for every one of them:

- no response is a 5xx;
- every error (status >= 400) is JSON `{code, message}`, both strings, and names no
  Python internals (no traceback);
- a response conforms to the schema where the schema says what it is (status, content
  type, body);
- without a valid credential, every operation that declares the bearer scheme answers
  401 `{code: "unauthenticated", message}`.

Runtime is bounded by CASES (25; RHIZOME_FUZZ_CASES for a longer run) per operation and
mode, about 13 operations; each test takes a few seconds on two cores."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from services.embedded.process import ManagedServer
from tests.integration.conftest import RunningApi, start_api

pytestmark = pytest.mark.integration

# Generated requests per operation and mode; RHIZOME_FUZZ_CASES raises it for a longer run.
CASES = int(os.environ.get("RHIZOME_FUZZ_CASES", "25"))
TRACEBACK_MARKERS = ("Traceback (most recent call last)", 'File "/', "site-packages")


def hypothesis_settings(cases: int = CASES) -> settings:
    return settings(
        max_examples=cases,
        deadline=None,
        database=None,
        derandomize=bool(os.environ.get("RHIZOME_FUZZ_DERANDOMIZE")),
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )


ELASTIC_MANIFEST = (
    "name: fuzz-elastic\nlearners: 2\nelastic: {min: 1, max: 4}\n"
    "framework:\n  command: python train.py\n"
)


@pytest.fixture(scope="module")
def api(
    mongo_server: ManagedServer, es_server: ManagedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningApi]:
    """The API with the training data service behind it, so the log and metric routes
    reach a real stream rather than stopping at "not configured"."""
    running = start_api(
        mongo_server.url,
        Path(tmp_path_factory.mktemp("fuzz-rest")),
        elasticsearch_url=es_server.url,
        services=("api", "tds"),
    )
    try:
        yield running
    finally:
        running.daemon.stop()


@pytest.fixture(scope="module")
def known_ids(api: RunningApi) -> dict[str, list[str]]:
    """Ids that exist, mixed into the generated path parameters so that the fuzzer gets
    past "not found": the fuzz user's jobs (one elastic) and a token an admin may revoke."""
    with api.client("fuzz-user") as rz:
        jobs = [
            rz.create_job(ELASTIC_MANIFEST).job_id,
            rz.create_job(ELASTIC_MANIFEST.replace("fuzz-elastic", "fuzz-other")).job_id,
        ]
    token = api.tokens.create("fuzz-victim", "user", created_by="tests").record.token_id
    return {"model_id": jobs, "token_id": [token]}


@pytest.fixture(scope="module")
def schema(api: RunningApi) -> Any:
    loaded = schemathesis.openapi.from_url(f"{api.rest}/openapi.json", timeout=10)
    return loaded


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


def operations(schema: Any) -> list[Any]:
    found = [result.ok() for result in schema.get_all_operations()]
    assert found, "the OpenAPI document has no operations"
    return found


def has_inputs(operation: Any) -> bool:
    """Whether the operation takes anything a negative case could break."""
    raw = operation.definition.raw
    return bool(raw.get("parameters") or raw.get("requestBody"))


def needs_auth(operation: Any) -> bool:
    """Whether the document says the operation takes the bearer token."""
    security = operation.definition.raw.get("security")
    if security is None:
        security = operation.schema.raw_schema.get("security", [])
    return bool(security)


def error_shape(response: Any) -> None:
    """An error is JSON `{code, message}`, both strings, with no traceback in it."""
    if response.status_code < 400:
        return
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(
            f"{response.status_code} error body is not JSON: {response.content[:300]!r}"
        ) from None
    assert isinstance(body, dict), f"error body is not an object: {body!r}"
    assert isinstance(body.get("code"), str) and body["code"], f"no string code: {body!r}"
    assert isinstance(body.get("message"), str) and body["message"], f"no message: {body!r}"
    for marker in TRACEBACK_MARKERS:
        assert marker not in body["message"], f"the error leaks internals: {body!r}"


def with_known_ids(strategy: Any, known: dict[str, list[str]]) -> Any:
    """Half the cases keep their generated path parameters, half get ids that exist."""

    @st.composite
    def known_case(draw: Any) -> Case:
        case: Case = draw(strategy)
        for name in case.path_parameters:
            if name in known:
                case.path_parameters[name] = draw(st.sampled_from(known[name]))
        return case

    return st.one_of(strategy, known_case())


def fuzz(
    api: RunningApi,
    session: requests.Session,
    operation: Any,
    mode: GenerationMode,
    headers: dict[str, str],
    verify: Callable[[Case, Any], None],
    known: dict[str, list[str]] | None = None,
    cases: int = CASES,
) -> None:
    strategy = operation.as_strategy(generation_mode=mode)
    if known:
        strategy = with_known_ids(strategy, known)

    @hypothesis_settings(cases)
    @given(case=strategy)
    def run(case: Case) -> None:
        response = case.call(base_url=api.rest, session=session, headers=headers, timeout=15)
        verify(case, response)

    run()


def conforms(headers: dict[str, str]) -> Callable[[Case, Any], None]:
    def verify(case: Case, response: Any) -> None:
        error_shape(response)
        checks: list[Callable[..., bool | None]] = [not_a_server_error]
        if case.meta is None or case.meta.generation.mode.is_positive:
            # What the document says of each answer holds for requests that fit it;
            # a request that breaks it only has to be refused cleanly.
            checks += [status_code_conformance, content_type_conformance]
            checks += [response_schema_conformance]
        case.validate_response(response, checks=checks, headers=headers)

    return verify


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation_answers_generated_requests_cleanly(
    api: RunningApi,
    schema: Any,
    session: requests.Session,
    known_ids: dict[str, list[str]],
    mode: GenerationMode,
) -> None:
    headers = api.headers("fuzz-user")
    for operation in operations(schema):
        if mode.is_positive or has_inputs(operation):
            fuzz(api, session, operation, mode, headers, conforms(headers), known_ids)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_an_admin_gets_clean_answers_too(
    api: RunningApi,
    schema: Any,
    session: requests.Session,
    known_ids: dict[str, list[str]],
    mode: GenerationMode,
) -> None:
    """An admin reaches the token routes' bodies (a user is refused before they are read)
    and every user's jobs."""
    headers = api.headers("fuzz-admin", "admin")
    for operation in operations(schema):
        if mode.is_positive or has_inputs(operation):
            fuzz(api, session, operation, mode, headers, conforms(headers), known_ids)


WRONG_CREDENTIALS = {
    "none": {},
    "unknown token": {"Authorization": "Bearer rz_" + "A" * 43},
    # legal HTTP, not a token (a control character is refused by the HTTP parser itself,
    # 400: tests/integration/test_api_rest.py)
    "not a token": {"Authorization": "Bearer not~a/token!"},
    "other scheme": {"Authorization": "Basic dXNlcjpwYXNz"},
    "empty bearer": {"Authorization": "Bearer "},
}


@pytest.mark.parametrize("credential", list(WRONG_CREDENTIALS))
def test_without_a_valid_token_every_operation_that_needs_one_is_401(
    api: RunningApi,
    schema: Any,
    session: requests.Session,
    known_ids: dict[str, list[str]],
    credential: str,
) -> None:
    headers = WRONG_CREDENTIALS[credential]
    protected = [op for op in operations(schema) if needs_auth(op)]
    assert len(protected) >= 10, "the document should declare the bearer scheme on the API"

    def verify(case: Case, response: Any) -> None:
        error_shape(response)
        assert response.status_code == 401, (
            f"{case.method} {case.formatted_path} without a valid token answered "
            f"{response.status_code}: {response.content[:300]!r}"
        )
        assert json.loads(response.content)["code"] == "unauthenticated"

    for operation in protected:
        # Valid requests, and (once) ones that break the schema: a caller without a
        # credential gets 401 before anything it sent is read.
        modes = [GenerationMode.POSITIVE]
        if credential == "none" and has_inputs(operation):
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            fuzz(api, session, operation, mode, headers, verify, known_ids, cases=CASES // 2)


def test_the_public_operations_need_no_token(
    api: RunningApi, schema: Any, session: requests.Session
) -> None:
    public = {op.path for op in operations(schema) if not needs_auth(op)}
    assert public == {"/healthz", "/v1/version", "/v1/manifest-schema"}
    for path in public:
        assert session.get(f"{api.rest}{path}", timeout=10).status_code == 200
