"""Job events (FfDL's `/v1/models/{id}/events/{event_type}`): webhooks a job's owner
registers per job and event type, called on the job's status changes.

The interface is `EventEndpoints` (where registrations live; `services/events/store.py`
keeps them in MongoDB) and the typed exceptions below; `services/events/delivery.py`
delivers. A delivery is a JSON POST signed with HMAC-SHA256 over its body under the
endpoint's secret (`X-Rhizome-Signature: sha256=<hex>`), so the receiver can tell it came
from the platform. The secret is generated here, returned once at creation and never
again, never logged. docs/api.md, "Events", says what a receiver sees and the SSRF
considerations.
"""

from __future__ import annotations

import abc
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from services.store import states

# `status`: every status change; a status in lower case: the change into that status.
ANY_STATUS = "status"
EVENT_TYPES = (ANY_STATUS, *(s.lower() for s in states.ALL_STATES))
MAX_URL = 2048
MAX_ENDPOINTS_PER_JOB = 32
SIGNATURE_HEADER = "X-Rhizome-Signature"
EVENT_HEADER = "X-Rhizome-Event"
DELIVERY_HEADER = "X-Rhizome-Delivery"
_ENDPOINT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class EventError(Exception):
    """Base of the events' refusals; the message says what was wrong and what to do."""


class BadEndpoint(EventError, ValueError):
    """A registration with a bad URL, event type or id."""


class EndpointNotFound(EventError, LookupError):
    pass


class EndpointExists(EventError):
    """An endpoint id that the job already has (FfDL lets the caller name endpoints)."""


class TooManyEndpoints(EventError):
    pass


@dataclass
class EndpointRecord:
    endpoint_id: str
    job_id: str
    owner: str
    event_type: str
    url: str
    secret: str = field(repr=False)  # signs deliveries; never returned after creation
    created_at: float = 0.0
    # How many entries of the job's history were handled (delivered, or given up on).
    delivered: int = 0


def check_event_type(event_type: str) -> str:
    lowered = event_type.strip().lower()
    if lowered not in EVENT_TYPES:
        raise BadEndpoint(
            f"event type {event_type!r} is not one we send; choose one of: {', '.join(EVENT_TYPES)}"
        )
    return lowered


def check_url(url: str) -> str:
    """An http(s) URL with a host and no credentials in it; BadEndpoint naming what is
    wrong otherwise. Which hosts may be called is the operator's concern (docs/api.md)."""
    if len(url) > MAX_URL:
        raise BadEndpoint(f"url is {len(url)} characters; at most {MAX_URL}")
    try:
        parts = urlsplit(url.strip())
        port = parts.port  # a bad port raises here
    except ValueError as exc:
        raise BadEndpoint(f"url {url!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise BadEndpoint(
            f"url scheme {parts.scheme or '(none)'!r} is not allowed; use http:// or https://"
        )
    if not parts.hostname:
        raise BadEndpoint(f"url {url!r} names no host; e.g. https://hooks.example.com/rhizome")
    if parts.username or parts.password:
        raise BadEndpoint(
            "url carries a user or password; authenticate deliveries by their signature "
            f"header ({SIGNATURE_HEADER}) instead"
        )
    del port
    return url.strip()


def check_endpoint_id(endpoint_id: str) -> str:
    if not _ENDPOINT_ID.match(endpoint_id):
        raise BadEndpoint(
            f"endpoint id {endpoint_id[:80]!r} is not valid: 1-64 letters, digits, '.', '_' "
            "or '-', starting with a letter or digit"
        )
    return endpoint_id


def new_endpoint_id() -> str:
    return "ep_" + secrets.token_hex(6)


def new_secret() -> str:
    return "whsec_" + secrets.token_urlsafe(32)


def sign(secret: str, body: bytes) -> str:
    """The signature header's value: what a receiver recomputes over the raw body."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class EventEndpoints(abc.ABC):
    """Where registrations live. Every call is scoped to one job; the caller (the API)
    has checked that the job is the caller's."""

    @abc.abstractmethod
    def create(self, record: EndpointRecord) -> EndpointRecord:
        """Store a new registration; EndpointExists, TooManyEndpoints."""

    @abc.abstractmethod
    def for_job(self, job_id: str, event_type: str = "") -> list[EndpointRecord]: ...

    @abc.abstractmethod
    def delete(self, job_id: str, event_type: str, endpoint_id: str) -> EndpointRecord:
        """Remove it and return it; EndpointNotFound."""

    @abc.abstractmethod
    def all(self) -> list[EndpointRecord]:
        """Every registration (the dispatcher's scan)."""

    @abc.abstractmethod
    def claim(self, record: EndpointRecord, holder: str, until: float, now: float) -> bool:
        """Take the endpoint's deliveries until `until` unless another holder has them:
        several API daemons share the store, and one endpoint is delivered by one."""

    @abc.abstractmethod
    def advance(self, record: EndpointRecord, holder: str, delivered: int) -> None:
        """Record how much of the job's history was handled, and release the claim."""

    @abc.abstractmethod
    def forget_job(self, job_id: str) -> None:
        """Drop every registration of a job that no longer exists."""
