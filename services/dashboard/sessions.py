"""Sessions sealed into the browser's cookie, so a restarted daemon keeps everyone signed in.

The cookie is the session: its id, the token the user signed in with, the session's CSRF
token and its expiry, encrypted and authenticated with AES-256-GCM (the `cryptography`
package, already pinned) under a key in `<state dir>/dashboard.key` (0600, generated on
first start). Encrypted, not only signed, because the token is a credential: the browser
holds it only as ciphertext it cannot read (and the cookie is HttpOnly). A cookie that
does not open under the key (tampered, or made under a key since deleted) is a sign-in
page, never an error.

Sign-out revokes the session's id: the id and its expiry go to
`<state dir>/dashboard-revoked.json` (0600), pruned as the sessions expire, so a copied
cookie stops working at once and stays dead across restarts. A token that stops working
(revoked or expired in the token store) ends its sessions by itself: every request
resolves the token again through the API's `Authenticator`.

One-time login codes (`rhizome up --embedded`'s link, ten minutes) stay in memory: a
restart in those ten minutes costs a new link, nothing else.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from services.api.auth import write_secret_file
from services.dashboard.api import NotSignedIn, Session, SessionStore

MAX_AGE_S = 12 * 3600.0
MAX_LOGIN_CODES = 100
MAX_COOKIE_CHARS = 4096
KEY_FILE = "dashboard.key"
REVOKED_FILE = "dashboard-revoked.json"
_AAD = b"rhizome dashboard session v1"


class DashboardKeyError(Exception):
    """The dashboard's key file cannot be used; the message says how to fix it."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def load_key(path: Path) -> bytes:
    """The 256-bit key in `path`, generated there (0600) when missing."""
    if not path.exists():
        write_secret_file(path, AESGCM.generate_key(bit_length=256).hex())
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        raise DashboardKeyError(
            f"{path} is readable by other users; `chmod 600 {path}` (or delete it and "
            "restart: every browser then signs in again)"
        )
    try:
        key = bytes.fromhex(path.read_text().strip())
    except ValueError:
        key = b""
    if len(key) != 32:
        raise DashboardKeyError(
            f"{path} does not hold a 64-hex-digit key; delete it and restart to generate one "
            "(every browser then signs in again)"
        )
    return key


class CookieSessionStore(SessionStore):
    """`state_dir` None: a key in memory only (sessions end with the process; for tests and
    gateways built without a data directory)."""

    def __init__(
        self,
        state_dir: Path | None,
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._revoked_path = state_dir / REVOKED_FILE if state_dir is not None else None
        key = (
            load_key(state_dir / KEY_FILE)
            if state_dir is not None
            else AESGCM.generate_key(bit_length=256)
        )
        self._aead = AESGCM(key)
        self._revoked: dict[str, float] = self._read_revoked()  # session id -> its expiry
        # code -> (secret, expires at)
        self._codes: dict[str, tuple[str, float]] = {}

    # -- the cookie ------------------------------------------------------------------------
    def create(self, secret: str) -> Session:
        now = self._clock()
        csrf = secrets.token_urlsafe(32)
        payload = {
            "sid": secrets.token_urlsafe(16),
            "tok": secret,
            "csrf": csrf,
            "iat": now,
            "exp": now + self.max_age_s,
        }
        nonce = os.urandom(12)
        sealed = self._aead.encrypt(nonce, json.dumps(payload).encode(), _AAD)
        return Session(
            session_id=_b64(nonce + sealed),
            secret=secret,
            csrf=csrf,
            created=now,
            last_seen=now,
        )

    def _open(self, cookie: str) -> dict[str, object]:
        if not cookie:
            raise NotSignedIn("please sign in")
        try:
            if len(cookie) > MAX_COOKIE_CHARS:
                raise ValueError("too long")
            raw = _unb64(cookie)
            payload = json.loads(self._aead.decrypt(raw[:12], raw[12:], _AAD))
            if not isinstance(payload, dict):
                raise ValueError("not an object")
            return payload
        except (ValueError, binascii.Error, InvalidTag):
            raise NotSignedIn(
                "this browser's session is not valid here (it was altered, or the "
                "dashboard's key changed); please sign in again"
            ) from None

    def get(self, session_id: str) -> Session:
        payload = self._open(session_id)
        now = self._clock()
        if float(str(payload.get("exp", 0))) < now:
            raise NotSignedIn("your session expired; please sign in again")
        with self._lock:
            if str(payload.get("sid", "")) in self._revoked:
                raise NotSignedIn("this session was signed out; please sign in again")
        return Session(
            session_id=session_id,
            secret=str(payload["tok"]),
            csrf=str(payload["csrf"]),
            created=float(str(payload["iat"])),
            last_seen=now,
        )

    def drop(self, session_id: str) -> None:
        try:
            payload = self._open(session_id)
        except NotSignedIn:
            return  # nothing this key could ever accept: nothing to revoke
        now = self._clock()
        with self._lock:
            self._revoked = {s: exp for s, exp in self._revoked.items() if exp >= now}
            self._revoked[str(payload["sid"])] = float(str(payload["exp"]))
            self._write_revoked()

    # -- revocations on disk ---------------------------------------------------------------
    def _read_revoked(self) -> dict[str, float]:
        if self._revoked_path is None or not self._revoked_path.exists():
            return {}
        try:
            found = json.loads(self._revoked_path.read_text())
            now = self._clock()
            return {str(s): float(e) for s, e in dict(found).items() if float(e) >= now}
        except (ValueError, TypeError) as exc:
            raise DashboardKeyError(
                f"{self._revoked_path} is not the dashboard's list of signed-out sessions "
                f"({exc}); delete it together with {KEY_FILE} and restart (every browser "
                "then signs in again)"
            ) from None

    def _write_revoked(self) -> None:
        if self._revoked_path is not None:
            # write_secret_file: 0600 and atomic (a crash never leaves half a list).
            write_secret_file(self._revoked_path, json.dumps(self._revoked))

    # -- one-time login codes --------------------------------------------------------------
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
