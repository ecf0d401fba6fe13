"""The dashboard's interface: the session store it signs browsers in with, and its errors.

A browser proves who it is with a session cookie, not a bearer header. The cookie holds
an opaque random session id; the token the user signed in with stays on the server, in
the session store, and every request resolves it again through the API's
`Authenticator`, so a revoked or expired token signs the browser out at once (within the
authenticator's cache bound), exactly as it stops an API call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


class DashboardError(Exception):
    """Something the dashboard refuses; the message says what and how to fix it."""


class NotSignedIn(DashboardError):
    """No session, an expired one, or a token that no longer works: back to the login."""


class CsrfRejected(DashboardError):
    """A state-changing request without the session's CSRF token."""


@dataclass
class Session:
    session_id: str
    secret: str  # the bearer token the user signed in with; never sent to the browser
    csrf: str  # echoed by every POST of this session (header X-CSRF-Token or form field)
    created: float
    last_seen: float


class SessionStore(ABC):
    """Where the signed-in browsers' sessions live, and the one-time login codes that
    `rhizome up --embedded` prints."""

    @abstractmethod
    def create(self, secret: str) -> Session:
        """A new session for a browser that proved it holds `secret`."""

    @abstractmethod
    def get(self, session_id: str) -> Session:
        """The live session with this id; NotSignedIn when there is none or it expired."""

    @abstractmethod
    def drop(self, session_id: str) -> None:
        """Forget a session (sign out); no error when it is already gone."""

    @abstractmethod
    def issue_login_code(self, secret: str, ttl_s: float) -> str:
        """A one-time code that signs a browser in as `secret`'s holder, once, within `ttl_s`."""

    @abstractmethod
    def redeem_login_code(self, code: str) -> str:
        """The secret behind a one-time code, which stops working now; NotSignedIn when
        the code is unknown, used or expired."""
