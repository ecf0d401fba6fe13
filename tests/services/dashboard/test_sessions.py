"""The dashboard's session store and its pure helpers (no servers: a fake clock, a
temporary state directory)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from services.dashboard.api import NotSignedIn
from services.dashboard.app import _safe_next, is_dashboard_path
from services.dashboard.sessions import (
    KEY_FILE,
    REVOKED_FILE,
    CookieSessionStore,
    DashboardKeyError,
)
from services.dashboard.submit import examples, manifest_problem
from services.dashboard.views import duration


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_session_works_until_its_maximum_age(tmp_path: Path) -> None:
    clock = Clock()
    store = CookieSessionStore(tmp_path, max_age_s=300, clock=clock)
    session = store.create("rz_secret")
    assert session.secret == "rz_secret" and session.csrf and session.session_id
    # The token is sealed, not merely signed: the cookie never shows it.
    assert "rz_secret" not in session.session_id
    clock.now += 299
    again = store.get(session.session_id)
    assert (again.secret, again.csrf) == ("rz_secret", session.csrf)
    clock.now += 2  # 301 s old
    with pytest.raises(NotSignedIn, match="expired"):
        store.get(session.session_id)
    with pytest.raises(NotSignedIn, match="sign in"):
        store.get("")


def test_a_session_survives_a_restart_and_a_sign_out_survives_it_too(tmp_path: Path) -> None:
    before = CookieSessionStore(tmp_path)
    kept, signed_out = before.create("rz_a"), before.create("rz_b")
    before.drop(signed_out.session_id)
    with pytest.raises(NotSignedIn, match="signed out"):
        before.get(signed_out.session_id)
    after = CookieSessionStore(tmp_path)  # a restarted daemon: the same files
    assert after.get(kept.session_id).secret == "rz_a"
    with pytest.raises(NotSignedIn, match="signed out"):
        after.get(signed_out.session_id)
    for name in (KEY_FILE, REVOKED_FILE):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name


def test_an_altered_or_foreign_cookie_is_a_sign_in_not_an_error(tmp_path: Path) -> None:
    store = CookieSessionStore(tmp_path)
    cookie = store.create("rz_a").session_id
    flipped = cookie[:-2] + ("A" if cookie[-2] != "A" else "B") + cookie[-1]
    other_key = CookieSessionStore(tmp_path / "elsewhere").create("rz_a").session_id
    for bad in (flipped, other_key, "not base64 !!", "x" * 5000, "AAAA"):
        with pytest.raises(NotSignedIn, match="sign in again"):
            store.get(bad)
    store.drop("garbage")  # signing out a cookie that never worked is no error


def test_a_key_file_others_can_read_is_refused_with_the_fix(tmp_path: Path) -> None:
    CookieSessionStore(tmp_path)
    (tmp_path / KEY_FILE).chmod(0o644)
    with pytest.raises(DashboardKeyError, match="chmod 600"):
        CookieSessionStore(tmp_path)
    (tmp_path / KEY_FILE).chmod(0o600)
    (tmp_path / KEY_FILE).write_text("short\n")
    with pytest.raises(DashboardKeyError, match="delete it and restart"):
        CookieSessionStore(tmp_path)


def test_a_login_code_works_once_and_not_after_its_time() -> None:
    clock = Clock()
    store = CookieSessionStore(None, clock=clock)
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


def test_the_job_view_names_each_learners_zone_and_which_stage_shadows_which() -> None:
    from services.dashboard.views import job_view, with_zones
    from services.manifest import parse_manifest
    from services.store.jobs import JobRecord

    manifest = parse_manifest(
        "name: pipe\nframework: {command: 'true'}\npipeline: {stages: 2, pipelines: 1}\n"
    )
    job = JobRecord.for_manifest("job-1", "alice", manifest, status="PROCESSING")
    job.placement = {"learner_nodes": {"0": "node-a", "1": "node-b"}}
    zones = {"node-a": "zone-1", "node-b": "zone-2"}
    view = with_zones(job_view(job, 0.0), job, zones)
    assert [(p["learner"], p["zone"]) for p in view["placement"]] == [(0, "zone-1"), (1, "zone-2")]
    assert [(r["learner"], r["stage"], r["zone"]) for r in view["stages"]] == [
        (0, 0, "zone-1"),
        (1, 1, "zone-2"),
    ]
    assert "its shadow, learner 0, runs in zone zone-1" in view["stages"][1]["why"]
    # Without the scheduler the zones are unknown, and the page says so rather than guess.
    unknown = with_zones(job_view(job, 0.0), job, None)
    assert unknown["placement"][0]["zone"] == "?"
    assert "zones unknown" in unknown["stages"][0]["why"]
    # A job that is not a pipeline has no stage table.
    plain = JobRecord.for_manifest(
        "job-2", "alice", parse_manifest("name: p\nframework: {command: 'true'}\n")
    )
    plain.placement = {"learner_nodes": {"0": "node-a"}}
    assert with_zones(job_view(plain, 0.0), plain, zones)["stages"] == []
