"""Sessions in the daemon's memory.

Why memory and not MongoDB: a session is only a pointer to a token that the token store
already keeps, so losing the sessions (a restarted daemon) costs a user one sign-in and
nothing else, and a browser's every request skips a database round-trip. Bounded: past
MAX_SESSIONS the least recently seen session is dropped.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from services.dashboard.api import NotSignedIn, Session, SessionStore

IDLE_TIMEOUT_S = 12 * 3600.0
MAX_AGE_S = 7 * 24 * 3600.0
MAX_SESSIONS = 10_000
MAX_LOGIN_CODES = 100


class MemorySessionStore(SessionStore):
    def __init__(
        self,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        # code -> (secret, expires at)
        self._codes: dict[str, tuple[str, float]] = {}

    def create(self, secret: str) -> Session:
        now = self._clock()
        session = Session(
            session_id=secrets.token_urlsafe(32),
            secret=secret,
            csrf=secrets.token_urlsafe(32),
            created=now,
            last_seen=now,
        )
        with self._lock:
            self._sessions[session.session_id] = session
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return session

    def get(self, session_id: str) -> Session:
        now = self._clock()
        with self._lock:
            session = self._sessions.get(session_id) if session_id else None
            if session is None:
                raise NotSignedIn("please sign in")
            if (
                now - session.last_seen > self.idle_timeout_s
                or now - session.created > self.max_age_s
            ):
                del self._sessions[session_id]
                raise NotSignedIn("your session expired; please sign in again")
            session.last_seen = now
            self._sessions.move_to_end(session_id)
            return session

    def drop(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def drop_secret(self, secret: str) -> None:
        """Sign out every session of a token that stopped working."""
        with self._lock:
            for sid in [s for s, v in self._sessions.items() if v.secret == secret]:
                del self._sessions[sid]

    def issue_login_code(self, secret: str, ttl_s: float) -> str:
        now = self._clock()
        code = secrets.token_urlsafe(32)
        with self._lock:
            self._codes = {c: v for c, v in self._codes.items() if v[1] > now}
            if len(self._codes) >= MAX_LOGIN_CODES:
                raise NotSignedIn(
                    f"{MAX_LOGIN_CODES} unused login links are pending; use one or wait for them to expire"
                )
            self._codes[code] = (secret, now + ttl_s)
        return code

    def redeem_login_code(self, code: str) -> str:
        now = self._clock()
        with self._lock:
            for known in list(self._codes):
                # Constant-time comparison: the code is a credential.
                if hmac.compare_digest(known.encode(), code.encode()):
                    secret, expires = self._codes.pop(known)
                    if expires < now:
                        break
                    return secret
        raise NotSignedIn(
            "this login link was already used or has expired; sign in with a token (on the "
            "embedded platform the admin's is in <data dir>/admin.token)"
        )
