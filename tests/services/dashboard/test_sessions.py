"""The dashboard's session store and its pure helpers (no servers: a fake clock)."""

from __future__ import annotations

import pytest

from services.dashboard import sessions as sessions_module
from services.dashboard.api import NotSignedIn
from services.dashboard.app import _safe_next, is_dashboard_path
from services.dashboard.sessions import MemorySessionStore
from services.dashboard.submit import examples, manifest_problem
from services.dashboard.views import duration


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_session_expires_after_its_idle_time_and_its_maximum_age() -> None:
    clock = Clock()
    store = MemorySessionStore(idle_timeout_s=60, max_age_s=300, clock=clock)
    session = store.create("rz_secret")
    assert session.secret == "rz_secret" and session.csrf and session.session_id
    for _ in range(5):  # used every 50 s: never idle for 60 s
        clock.now += 50
        assert store.get(session.session_id) is session
    clock.now += 51  # 301 s old
    with pytest.raises(NotSignedIn, match="expired"):
        store.get(session.session_id)
    other = store.create("rz_other")
    clock.now += 61
    with pytest.raises(NotSignedIn, match="expired"):
        store.get(other.session_id)
    with pytest.raises(NotSignedIn, match="sign in"):
        store.get("")


def test_sign_out_and_a_refused_token_drop_their_sessions() -> None:
    store = MemorySessionStore()
    a, b, c = store.create("rz_a"), store.create("rz_b"), store.create("rz_b")
    store.drop(a.session_id)
    store.drop_secret("rz_b")
    for gone in (a, b, c):
        with pytest.raises(NotSignedIn):
            store.get(gone.session_id)


def test_the_least_recently_seen_session_goes_first_past_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sessions_module, "MAX_SESSIONS", 2)
    store = MemorySessionStore()
    first, second = store.create("rz_1"), store.create("rz_2")
    store.get(first.session_id)  # first is now the most recently seen
    store.create("rz_3")
    assert store.get(first.session_id) is first
    with pytest.raises(NotSignedIn):
        store.get(second.session_id)


def test_a_login_code_works_once_and_not_after_its_time() -> None:
    clock = Clock()
    store = MemorySessionStore(clock=clock)
    code = store.issue_login_code("rz_admin", ttl_s=600)
    assert store.redeem_login_code(code) == "rz_admin"
    with pytest.raises(NotSignedIn, match="already used or has expired"):
        store.redeem_login_code(code)
    late = store.issue_login_code("rz_admin", ttl_s=600)
    clock.now += 601
    with pytest.raises(NotSignedIn, match="already used or has expired"):
        store.redeem_login_code(late)
    with pytest.raises(NotSignedIn):
        store.redeem_login_code("made-up")


def test_only_paths_on_this_site_are_followed_after_sign_in() -> None:
    assert _safe_next("/jobs/job-1") == "/jobs/job-1"
    for hostile in ("//evil.example/", "https://evil.example/", "/\\evil.example", ""):
        assert _safe_next(hostile) == "/"


def test_the_dashboard_paths_leave_the_api_to_bearer_tokens() -> None:
    for path in ("/", "/login", "/jobs/job-1", "/submit", "/cluster", "/estimate", "/ui/jobs"):
        assert is_dashboard_path(path), path
    for path in ("/v1/models", "/healthz", "/openapi.json", "/favicon.ico"):
        assert not is_dashboard_path(path), path


def test_a_manifest_problem_names_its_field() -> None:
    assert manifest_problem("name: ok\nframework: {command: 'true'}\n") == {}
    wrong = manifest_problem("name: x\nlearners: many\nframework: {command: 'true'}\n")
    assert wrong["field"] == "learners" and wrong["problem"]
    assert manifest_problem("  ")["problem"] == "the manifest is empty"


def test_the_repository_examples_are_offered() -> None:
    found = examples()
    assert "mnist" in found and "name: mnist-digits" in found["mnist"].manifest
    assert "pipeline-gpt" in found  # a manifest.yaml


def test_durations_read_compactly() -> None:
    assert [duration(s) for s in (5, 65, 3725, 93600)] == ["5s", "1m 05s", "1h 02m", "1d 2h"]
