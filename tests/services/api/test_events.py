"""The job-event rules the API enforces (services/events/api.py) and which history
entries the dispatcher sends (services/events/delivery.py). No servers: pure functions."""

from __future__ import annotations

import hashlib
import hmac
import re

import pytest

from services.events import api as events
from services.events.delivery import payload, status_changes, wanted, where
from services.store.jobs import JobRecord, StatusEntry


def job(*statuses: str) -> JobRecord:
    return JobRecord(
        job_id="job-1",
        owner="u",
        name="n",
        manifest={},
        resources={},
        history=[StatusEntry(s, float(i), f"m{i}") for i, s in enumerate(statuses)],
    )


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8080/hook", "https://hooks.example.com/x?k=1", " http://h/ "]
)
def test_http_and_https_urls_are_accepted(url: str) -> None:
    assert events.check_url(url) == url.strip()


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("ftp://h/x", "scheme 'ftp' is not allowed"),
        ("javascript:alert(1)", "scheme 'javascript' is not allowed"),
        ("//h/x", "scheme '(none)' is not allowed"),
        ("https://", "names no host"),
        ("https://a:b@h/", "carries a user or password"),
        ("http://h:0x50/", "is not a URL"),
        ("http://h/" + "x" * 3000, "at most 2048"),
    ],
)
def test_other_urls_are_refused_saying_why(url: str, fragment: str) -> None:
    with pytest.raises(events.BadEndpoint, match=re.escape(fragment)):
        events.check_url(url)


def test_event_types_are_status_or_a_status_in_lower_case() -> None:
    assert events.check_event_type("Completed") == "completed"
    assert events.check_event_type("status") == "status"
    with pytest.raises(events.BadEndpoint, match="choose one of: status, queued"):
        events.check_event_type("done")


def test_endpoint_ids_are_short_and_plain() -> None:
    assert events.check_endpoint_id("my-hook_1.a") == "my-hook_1.a"
    for bad in ("", "-x", "a/b", "x" * 65, "a b"):
        with pytest.raises(events.BadEndpoint):
            events.check_endpoint_id(bad)
    assert events.new_endpoint_id() != events.new_endpoint_id()


def test_the_signature_is_hmac_sha256_of_the_body() -> None:
    body = b'{"a": 1}'
    expected = hmac.new(b"s3cret", body, hashlib.sha256).hexdigest()
    assert events.sign("s3cret", body) == "sha256=" + expected
    assert events.sign("other", body) != events.sign("s3cret", body)


def test_only_status_changes_after_the_cursor_are_sent() -> None:
    record = job("QUEUED", "QUEUED", "PENDING", "PENDING", "HALTED")  # notes under a status
    sent = [(i, e.status, prev) for i, e, prev in status_changes(record, 0)]
    assert sent == [(2, "PENDING", "QUEUED"), (4, "HALTED", "PENDING")]
    assert [i for i, _, _ in status_changes(record, 3)] == [4]
    assert status_changes(record, 5) == []


def test_an_endpoint_wants_every_change_or_its_own_status() -> None:
    def endpoint(kind: str) -> events.EndpointRecord:
        return events.EndpointRecord("e", "job-1", "u", kind, "http://h/", "s")

    assert wanted(endpoint("status"), "FAILED")
    assert wanted(endpoint("failed"), "FAILED")
    assert not wanted(endpoint("completed"), "FAILED")


def test_the_payload_carries_no_secret_and_the_log_form_no_query() -> None:
    ep = events.EndpointRecord("e", "job-1", "u", "status", "http://h/p?key=k", "whsec_x")
    record = job("QUEUED", "HALTED")
    body = payload(ep, record, record.history[1], "QUEUED")
    assert b"whsec_x" not in body and b"HALTED" in body
    assert where(ep.url) == "http://h/p"
    assert "whsec_x" not in repr(ep)
