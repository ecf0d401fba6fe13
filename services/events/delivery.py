"""Deliver job events to their webhooks without ever holding up a job.

The platform's status changes are written by many processes (API, scheduler, LCM,
guardians); none of them calls a webhook. The `Dispatcher` runs in the API daemon: every
`poll_s` it reads the registered endpoints and their jobs' histories, and hands each
endpoint with new status changes to a small pool of delivery threads. A slow or dead
endpoint occupies one delivery thread for at most `attempts` tries of `timeout_s` each
(with backoff between them), and only its own deliveries wait meanwhile: the guardian and
the LCM never wait on a webhook, and other endpoints are served by the other threads.

An endpoint is delivered in order, at least once: its cursor (`delivered`) moves past an
event once the receiver answered 2xx or the tries are spent (logged, without the URL's
query or the secret). Several API daemons sharing the store take an endpoint by a claim
with a lease, so one event is normally sent once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from services.events.api import (
    ANY_STATUS,
    DELIVERY_HEADER,
    EVENT_HEADER,
    SIGNATURE_HEADER,
    EndpointNotFound,
    EndpointRecord,
    EventEndpoints,
    sign,
)
from services.store import states
from services.store.errors import JobNotFound
from services.store.jobs import JobRecord, StatusEntry

log = logging.getLogger("rhizome.events")


@dataclass(frozen=True)
class DeliveryPolicy:
    poll_s: float = 1.0
    attempts: int = 5
    timeout_s: float = 5.0
    backoff_s: float = 0.5  # doubled after each failed try
    workers: int = 4


def status_changes(job: JobRecord, start: int) -> list[tuple[int, StatusEntry, str]]:
    """(index, entry, previous status) of each history entry from `start` on that moved
    the job to another status (the history also holds notes under the same status)."""
    out = []
    for i in range(max(start, 1), len(job.history)):
        previous = job.history[i - 1].status
        if job.history[i].status != previous:
            out.append((i, job.history[i], previous))
    return out


def wanted(endpoint: EndpointRecord, status: str) -> bool:
    return endpoint.event_type in (ANY_STATUS, status.lower())


def payload(endpoint: EndpointRecord, job: JobRecord, entry: StatusEntry, previous: str) -> bytes:
    return json.dumps(
        {
            "endpoint_id": endpoint.endpoint_id,
            "event_type": endpoint.event_type,
            "job_id": job.job_id,
            "name": job.name,
            "status": entry.status,
            "previous_status": previous,
            "message": entry.message,
            "time": entry.time,
        },
        sort_keys=True,
    ).encode()


def where(url: str) -> str:
    """The URL as logged: scheme, host and path, never its query (it may carry a key)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


class Dispatcher:
    def __init__(
        self,
        endpoints: EventEndpoints,
        load_job: Callable[[str], JobRecord],
        policy: DeliveryPolicy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.endpoints = endpoints
        self.load_job = load_job
        self.policy = policy or DeliveryPolicy()
        self.clock = clock
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self._stop = threading.Event()
        self._busy: set[str] = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.policy.workers, thread_name_prefix="webhook")
        self._http: Any = None  # made on the first delivery (_client)
        self._thread = threading.Thread(target=self._run, name="event-dispatcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._http is not None:
            self._http.close()

    def _run(self) -> None:
        while not self._stop.wait(self.policy.poll_s):
            try:
                self.scan()
            except Exception:  # a store hiccup: the next scan tries again
                log.warning("event scan failed; retrying", exc_info=True)

    def scan(self) -> None:
        """Hand every endpoint with undelivered status changes to a delivery thread."""
        jobs: dict[str, JobRecord | None] = {}
        for endpoint in self.endpoints.all():
            key = f"{endpoint.job_id}/{endpoint.endpoint_id}"
            with self._lock:
                if key in self._busy:
                    continue
            if endpoint.job_id not in jobs:
                try:
                    jobs[endpoint.job_id] = self.load_job(endpoint.job_id)
                except JobNotFound:
                    jobs[endpoint.job_id] = None
            job = jobs[endpoint.job_id]
            if job is None:
                self.endpoints.forget_job(endpoint.job_id)
                continue
            if len(job.history) <= endpoint.delivered:
                if job.status == states.DELETED:
                    # Nothing follows DELETED: its last event is out, the endpoint is done.
                    with contextlib.suppress(EndpointNotFound):
                        self.endpoints.delete(job.job_id, endpoint.event_type, endpoint.endpoint_id)
                continue
            now = self.clock()
            lease = now + self.policy.attempts * (self.policy.timeout_s + 60)
            if not self.endpoints.claim(endpoint, self.holder, lease, now):
                continue
            with self._lock:
                self._busy.add(key)
            self._pool.submit(self._deliver_all, key, endpoint, job)

    def _deliver_all(self, key: str, endpoint: EndpointRecord, job: JobRecord) -> None:
        delivered = endpoint.delivered
        try:
            for index, entry, previous in status_changes(job, endpoint.delivered):
                if self._stop.is_set():
                    return
                if wanted(endpoint, entry.status):
                    self.deliver(endpoint, job, entry, previous, index)
                delivered = index + 1
            delivered = max(delivered, len(job.history))
        finally:
            try:
                self.endpoints.advance(endpoint, self.holder, delivered)
            except Exception:
                log.warning("could not record event deliveries of %s", key, exc_info=True)
            with self._lock:
                self._busy.discard(key)

    def _client(self) -> Any:
        """The HTTP client, made on the first delivery: importing httpx is about 0.1 s of
        CPU on a restarted daemon's way to serving, and most platforms register no
        webhook."""
        with self._lock:
            if self._http is None:
                import httpx

                # No redirects: a receiver could otherwise bounce a delivery to an address
                # the owner could not register (docs/api.md, "SSRF").
                self._http = httpx.Client(timeout=self.policy.timeout_s, follow_redirects=False)
            return self._http

    def deliver(
        self,
        endpoint: EndpointRecord,
        job: JobRecord,
        entry: StatusEntry,
        previous: str,
        index: int,
    ) -> bool:
        """POST one event, retrying; True once the receiver answered 2xx."""
        import httpx

        client = self._client()
        body = payload(endpoint, job, entry, previous)
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "rhizome-webhooks",
            EVENT_HEADER: endpoint.event_type,
            DELIVERY_HEADER: f"{job.job_id}/{endpoint.endpoint_id}/{index}",
            SIGNATURE_HEADER: sign(endpoint.secret, body),
        }
        wait = self.policy.backoff_s
        why: Any = ""
        for attempt in range(1, self.policy.attempts + 1):
            try:
                response = client.post(endpoint.url, content=body, headers=headers)
                if 200 <= response.status_code < 300:
                    return True
                why = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                why = type(exc).__name__
            if attempt < self.policy.attempts and self._stop.wait(wait):
                break
            wait *= 2
        log.warning(
            "job %s: event %s to endpoint %s (%s) not delivered after %d tries: %s",
            job.job_id,
            entry.status,
            endpoint.endpoint_id,
            where(endpoint.url),
            self.policy.attempts,
            why,
        )
        return False
