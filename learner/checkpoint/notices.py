"""Preemption notice sources, registered by name: `sigterm`, `aws`, `azure`, `gcp`.

Each source reports the time left before the node goes away:
- `sigterm`: the platform (or the cloud's node agent) sends SIGTERM and kills the process
  `RHIZOME_GRACE_S` seconds later.
- `aws`: EC2 spot `instance-action` (`{"action": "terminate", "time": "...Z"}`, 404 while
  nothing is planned), IMDSv2 token when the endpoint gives one, IMDSv1 otherwise.
- `azure`: scheduled events, an event of type `Preempt` with its `NotBefore` time;
  acknowledging it POSTs a `StartRequests` so Azure may go ahead early.
- `gcp`: `instance/preempted` turning `TRUE`; GCP gives no time, so the deadline is the
  configured grace (GCP's documented notice is 30 s).

The metadata sources poll once per `RHIZOME_NOTICE_POLL_S` at `RHIZOME_METADATA_URL`, so
tests serve the endpoints on 127.0.0.1.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from datetime import datetime
from email.utils import parsedate_to_datetime
from types import FrameType
from typing import Any

from contract.env import LearnerEnv
from contract.registry import Registry
from learner.checkpoint.api import (
    NoticeCallback,
    NoticeSourceError,
    PreemptionNotice,
    PreemptionNoticeSource,
)

log = logging.getLogger(__name__)

SourceFactory = Callable[[LearnerEnv], PreemptionNoticeSource]
SOURCES: Registry[SourceFactory] = Registry(
    "preemption notice source",
    error=lambda message: NoticeSourceError(
        f"{message} (RHIZOME_NOTICE_SOURCES takes a comma-separated list of them)"
    ),
)


def register(name: str, factory: SourceFactory | str) -> None:
    """Make a notice source available under `name` (as in RHIZOME_NOTICE_SOURCES)."""
    SOURCES.register(name, factory)


def registered() -> list[str]:
    return SOURCES.names()


def create(name: str, env: LearnerEnv) -> PreemptionNoticeSource:
    return SOURCES.get(name)(env)


# The longest notice each cloud documents; SIGTERM and GCP use the configured grace.
NOMINAL_GRACE_S = {"aws": 120.0, "azure": 30.0}


def expected_grace_s(sources: Iterable[PreemptionNoticeSource], grace_s: float) -> float:
    """The shortest notice the configured sources give (0 without a source)."""
    graces = [NOMINAL_GRACE_S.get(s.name, grace_s) for s in sources]
    return min(graces) if graces else 0.0


class NoticeBoard:
    """The notice sources of one process and the earliest notice they gave.

    What the checkpoint manager and the pipeline runtime (learner/runtime/halt.py) share:
    start the sources, keep the notice with the earliest deadline, acknowledge it. The
    callback runs in a signal handler or a polling thread, so it only records (no lock: a
    signal handler that waited for a lock its own thread holds would never return);
    readers look at `notice` when it suits them (a step boundary, a watcher's wake-up).
    """

    def __init__(self, sources: list[PreemptionNoticeSource]) -> None:
        self.sources = sources
        self.notice: PreemptionNotice | None = None
        self.source: PreemptionNoticeSource | None = None

    @classmethod
    def from_env(cls, env: LearnerEnv) -> NoticeBoard:
        """The sources `RHIZOME_NOTICE_SOURCES` names (not started)."""
        return cls([create(name, env) for name in env.notice_sources])

    def on_notice(self, notice: PreemptionNotice) -> None:
        if self.notice is None or notice.deadline < self.notice.deadline:
            self.notice = notice
            self.source = next((s for s in self.sources if s.name == notice.source), None)

    def start(self) -> NoticeBoard:
        """Start every source (the `sigterm` one from the main thread only)."""
        for source in self.sources:
            source.start(self.on_notice)
        return self

    def acknowledge(self) -> None:
        """Tell the notice's source it was acted on (Azure may then go ahead early)."""
        if self.notice is not None and self.source is not None:
            self.source.acknowledge(self.notice)

    def stop(self) -> None:
        for source in self.sources:
            source.stop()


class SigtermSource(PreemptionNoticeSource):
    """SIGTERM now, SIGKILL `grace_s` later."""

    name = "sigterm"

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._previous: Any = None
        self._installed = False

    def start(self, callback: NoticeCallback) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise NoticeSourceError(
                "the sigterm notice source must be started from the main thread "
                "(Python only delivers signals there); initialise the SDK before spawning threads"
            )

        def _on_sigterm(signum: int, frame: FrameType | None) -> None:
            now = time.time()
            callback(PreemptionNotice("sigterm", now, now + self.grace_s, {"signal": signum}))

        self._previous = signal.signal(signal.SIGTERM, _on_sigterm)
        self._installed = True

    def stop(self) -> None:
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            self._installed = False


class PollingSource(PreemptionNoticeSource):
    """Polls an HTTP endpoint from a daemon thread; subclasses parse the answer."""

    def __init__(self, base_url: str, poll_s: float, timeout_s: float = 0.5) -> None:
        self.base_url = base_url.rstrip("/")
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.notice: PreemptionNotice | None = None

    def _get(self, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        req = urllib.request.Request(self.base_url + path, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return int(resp.status), resp.read()
        except urllib.error.HTTPError as err:
            return int(err.code), b""

    def poll_once(self) -> PreemptionNotice | None:
        """One poll; None when no preemption is planned or the endpoint is unreachable."""
        try:
            return self.check()
        except (OSError, ValueError) as err:
            # A metadata endpoint that hiccups must not stop training: try again next poll.
            log.debug("%s notice poll failed: %s", self.name, err)
            return None

    def check(self) -> PreemptionNotice | None:
        raise NotImplementedError

    def start(self, callback: NoticeCallback) -> None:
        def _loop() -> None:
            while not self._stop.is_set():
                notice = self.poll_once()
                if notice is not None:
                    self.notice = notice
                    callback(notice)
                    return
                self._stop.wait(self.poll_s)

        self._thread = threading.Thread(
            target=_loop, name=f"rhizome-notice-{self.name}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout_s + self.poll_s)


class AwsSpotSource(PollingSource):
    name = "aws"
    path = "/latest/meta-data/spot/instance-action"

    def _token(self) -> str | None:
        req = urllib.request.Request(
            self.base_url + "/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.read().decode().strip() or None
        except (OSError, urllib.error.HTTPError):
            return None

    def check(self) -> PreemptionNotice | None:
        token = self._token()
        headers = {"X-aws-ec2-metadata-token": token} if token else {}
        status, body = self._get(self.path, headers)
        if status != 200:
            return None
        doc = json.loads(body)
        when = datetime.fromisoformat(str(doc["time"]).replace("Z", "+00:00")).timestamp()
        return PreemptionNotice("aws", time.time(), when, {"action": doc.get("action")})


class AzureScheduledEventsSource(PollingSource):
    name = "azure"
    path = "/metadata/scheduledevents?api-version=2020-07-01"

    def check(self) -> PreemptionNotice | None:
        status, body = self._get(self.path, {"Metadata": "true"})
        if status != 200:
            return None
        for event in json.loads(body).get("Events", []):
            if event.get("EventType") != "Preempt":
                continue
            now = time.time()
            not_before = event.get("NotBefore") or ""
            # An empty NotBefore means the event has already started: no time left.
            deadline = parsedate_to_datetime(not_before).timestamp() if not_before else now
            return PreemptionNotice("azure", now, deadline, {"event_id": event.get("EventId")})
        return None

    def acknowledge(self, notice: PreemptionNotice) -> None:
        event_id = notice.detail.get("event_id")
        if not event_id:
            return
        data = json.dumps({"StartRequests": [{"EventId": event_id}]}).encode()
        req = urllib.request.Request(
            self.base_url + self.path,
            data=data,
            method="POST",
            headers={"Metadata": "true", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s):
                pass
        except OSError as err:
            log.warning("could not acknowledge Azure event %s: %s", event_id, err)


class GcpPreemptedSource(PollingSource):
    name = "gcp"
    path = "/computeMetadata/v1/instance/preempted"

    def __init__(self, base_url: str, poll_s: float, grace_s: float) -> None:
        super().__init__(base_url, poll_s)
        self.grace_s = grace_s

    def check(self) -> PreemptionNotice | None:
        status, body = self._get(self.path, {"Metadata-Flavor": "Google"})
        if status != 200 or body.strip().upper() != b"TRUE":
            return None
        now = time.time()
        return PreemptionNotice("gcp", now, now + self.grace_s)


register("sigterm", lambda env: SigtermSource(env.grace_s))
register("aws", lambda env: AwsSpotSource(env.metadata_url, env.notice_poll_s))
register("azure", lambda env: AzureScheduledEventsSource(env.metadata_url, env.notice_poll_s))
register("gcp", lambda env: GcpPreemptedSource(env.metadata_url, env.notice_poll_s, env.grace_s))
