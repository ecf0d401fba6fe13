"""Notice sources against cloud metadata endpoints served on 127.0.0.1, and SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from contract.env import LearnerEnv
from learner.checkpoint import notices
from learner.checkpoint.api import NoticeSourceError, PreemptionNotice


class FakeMetadata:
    """What the endpoints answer: set `aws`, `azure_events`, `gcp` in a test."""

    def __init__(self) -> None:
        self.aws: dict[str, Any] | None = None
        self.azure_events: list[dict[str, Any]] = []
        self.gcp = "FALSE"
        self.posts: list[dict[str, Any]] = []
        self.headers: dict[str, dict[str, str]] = {}


@pytest.fixture()
def metadata() -> Iterator[tuple[FakeMetadata, str]]:
    state = FakeMetadata()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            return

        def _send(self, code: int, body: bytes = b"") -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_PUT(self) -> None:
            if self.path == "/latest/api/token":
                self._send(200, b"tok-123")
            else:
                self._send(404)

        def do_GET(self) -> None:
            state.headers[self.path.split("?")[0]] = {k.lower(): v for k, v in self.headers.items()}
            if self.path == "/latest/meta-data/spot/instance-action":
                if state.aws is None:
                    self._send(404)
                else:
                    self._send(200, json.dumps(state.aws).encode())
            elif self.path.startswith("/metadata/scheduledevents"):
                body = {"DocumentIncarnation": 1, "Events": state.azure_events}
                self._send(200, json.dumps(body).encode())
            elif self.path == "/computeMetadata/v1/instance/preempted":
                self._send(200, state.gcp.encode())
            else:
                self._send(404)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            state.posts.append(json.loads(self.rfile.read(length)))
            self._send(200)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _env(url: str, **kw: Any) -> LearnerEnv:
    return LearnerEnv(metadata_url=url, notice_poll_s=0.05, **kw)


def test_aws_reports_time_left_until_instance_action(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    source = notices.create("aws", _env(url))
    assert isinstance(source, notices.PollingSource)
    assert source.poll_once() is None  # 404: nothing planned
    when = time.time() + 120
    state.aws = {
        "action": "terminate",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when)),
    }
    notice = source.poll_once()
    assert notice is not None and notice.source == "aws"
    assert notice.deadline == pytest.approx(int(when), abs=1.0)
    assert (
        state.headers["/latest/meta-data/spot/instance-action"].get("x-aws-ec2-metadata-token")
        == "tok-123"
    )


def test_azure_preempt_event_and_acknowledgement(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    source = notices.create("azure", _env(url))
    assert isinstance(source, notices.PollingSource)
    state.azure_events = [{"EventId": "A", "EventType": "Reboot", "NotBefore": ""}]
    assert source.poll_once() is None  # not a preemption
    not_before = int(time.time()) + 30
    state.azure_events.append(
        {"EventId": "B", "EventType": "Preempt", "NotBefore": formatdate(not_before, usegmt=True)}
    )
    notice = source.poll_once()
    assert notice is not None and notice.detail["event_id"] == "B"
    assert notice.deadline == pytest.approx(not_before, abs=1.0)
    assert state.headers["/metadata/scheduledevents"]["metadata"] == "true"
    source.acknowledge(notice)
    assert state.posts == [{"StartRequests": [{"EventId": "B"}]}]


def test_gcp_preempted_flag_uses_configured_grace(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    source = notices.create("gcp", _env(url, grace_s=30.0))
    assert isinstance(source, notices.PollingSource)
    assert source.poll_once() is None
    state.gcp = "TRUE"
    before = time.time()
    notice = source.poll_once()
    assert notice is not None
    assert before + 30 <= notice.deadline <= time.time() + 30
    assert state.headers["/computeMetadata/v1/instance/preempted"]["metadata-flavor"] == "Google"


def test_polling_thread_calls_back_once(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    got: list[PreemptionNotice] = []
    seen = threading.Event()

    def callback(n: PreemptionNotice) -> None:
        got.append(n)
        seen.set()

    source = notices.create("gcp", _env(url))
    source.start(callback)
    try:
        state.gcp = "TRUE"
        assert seen.wait(10), "the gcp source never reported the preemption"
    finally:
        source.stop()
    assert len(got) == 1


def test_unreachable_endpoint_is_no_notice() -> None:
    source = notices.create("aws", _env("http://127.0.0.1:9"))
    assert isinstance(source, notices.PollingSource)
    assert source.poll_once() is None


def test_sigterm_reports_the_configured_grace() -> None:
    got: list[PreemptionNotice] = []
    source = notices.create("sigterm", LearnerEnv(grace_s=42.0))
    before = signal.getsignal(signal.SIGTERM)
    source.start(got.append)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        source.stop()
    assert len(got) == 1 and got[0].source == "sigterm"
    assert got[0].deadline - got[0].received_at == pytest.approx(42.0)
    assert signal.getsignal(signal.SIGTERM) == before


def test_unknown_source_names_the_known_ones() -> None:
    with pytest.raises(NoticeSourceError, match="aws, azure, gcp, sigterm"):
        notices.create("ibm", LearnerEnv())
