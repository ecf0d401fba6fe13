"""Who is calling: one code path from a request's credential to a `Principal`, used by
both the gRPC servicer and the REST gateway, plus the admin-only token management.

A caller proves who they are with a bearer token (`authorization: Bearer rz_...` gRPC
metadata, `Authorization: Bearer rz_...` HTTP header). The plain user header
(`x-rhizome-user`, FfDL's `X-Watson-Userinfo`) is believed only when the daemon runs with
`--insecure-trust-user-header`, and only when no token is sent.

Valid lookups are cached for `cache_s` seconds (default 5, `--auth-cache-seconds`), so a
submit does not pay a MongoDB round-trip each time. A revoke through this daemon drops the
token from its cache at once; another daemon sharing the store stops accepting it within
`cache_s`. An expiry is checked on every call, cached or not.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pymongo.errors

from contract.credentials import redact_uri
from services.api import errors
from services.store.errors import StoreUnavailable
from services.store.tokens import (
    ROLES,
    BadTokenRequest,
    ExpiredToken,
    InvalidToken,
    RevokedToken,
    TokenNotFound,
    TokenRecord,
    TokensRepository,
)

USER_METADATA = "x-rhizome-user"
AUTHORIZATION_METADATA = "authorization"
USER_HEADER = "X-Rhizome-User"
# FfDL sent the user as `X-Watson-Userinfo: bluemix-instance-id=<user>`.
WATSON_HEADER = "X-Watson-Userinfo"
DEFAULT_CACHE_S = 5.0
MAX_CACHE_ENTRIES = 10_000
MAX_USER_LENGTH = 128
MAX_TOKEN_LIFETIME_S = 10 * 365 * 86400

HOW_TO_GET_A_TOKEN = (
    "send `authorization: Bearer <token>` (gRPC metadata) or `Authorization: Bearer <token>` "
    "(HTTP). An admin creates one with `rhizome token create --user YOU`; the CLI and SDK "
    "read it from --token / token= or $RHIZOME_TOKEN, and on the embedded platform from "
    "<data dir>/admin.token"
)


@dataclass(frozen=True)
class Principal:
    """The authenticated caller: the user id jobs are owned by, and a role."""

    user: str
    role: str = "user"
    token_id: str = ""  # empty when the user came from a trusted header

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


def as_principal(who: Principal | str) -> Principal:
    """A Principal; a bare user id (internal callers, tests) is a user-role principal."""
    if isinstance(who, Principal):
        return who
    user = (who or "").strip()
    if not user:
        raise errors.Unauthenticated(f"no credential: {HOW_TO_GET_A_TOKEN}")
    if len(user) > MAX_USER_LENGTH:
        raise errors.BadRequest(f"user id longer than {MAX_USER_LENGTH} characters")
    return Principal(user)


def watson_user(value: str | None) -> str:
    if value and "bluemix-instance-id=" in value:
        return value.split("bluemix-instance-id=", 1)[1].split(";")[0].strip()
    return ""


def bearer(authorization: str | None) -> str:
    """The token in an `Authorization` value; empty when there is none; 401 when malformed."""
    if not authorization:
        return ""
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise errors.Unauthenticated(
            f"malformed authorization: expected `Bearer <token>`; {HOW_TO_GET_A_TOKEN}"
        )
    return token.strip()


class Authenticator:
    def __init__(
        self,
        tokens: TokensRepository | None,
        trust_user_header: bool = False,
        cache_s: float = DEFAULT_CACHE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tokens = tokens
        self.trust_user_header = trust_user_header
        self.cache_s = max(0.0, cache_s)
        self._clock = clock
        self._lock = threading.Lock()
        # secret -> (record, when it was looked up); the key never leaves this process.
        self._cache: dict[str, tuple[TokenRecord, float]] = {}

    # -- who is calling -------------------------------------------------------------------
    def from_grpc(self, metadata: Iterable[tuple[str, Any]] | None) -> Principal:
        authorization = user = ""
        for key, value in metadata or ():
            if key == AUTHORIZATION_METADATA:
                authorization = str(value)
            elif key == USER_METADATA:
                user = str(value)
        return self.resolve(authorization, user)

    def from_http(self, headers: Any) -> Principal:
        user = headers.get(USER_HEADER) or watson_user(headers.get(WATSON_HEADER))
        return self.resolve(headers.get("authorization", ""), user or "")

    def from_http_without_lookup(self, headers: Any) -> Principal | None:
        """`from_http` when it needs no token store (a fresh cache hit, or no token at
        all); None when only a lookup can tell. The REST gateway calls this on its event
        loop and goes to a worker thread only for the lookup: a thread hop per request
        was a visible part of a REST submit's cost (issue #18)."""
        token = bearer(headers.get("authorization", ""))
        if not token:
            return self.from_http(headers)  # the user header, or 401: no store either way
        record = self._cached(token)
        return None if record is None else Principal(record.user, record.role, record.token_id)

    def resolve(self, authorization: str, user_header: str = "") -> Principal:
        token = bearer(authorization)
        if token:
            record = self._lookup(token)
            return Principal(record.user, record.role, record.token_id)
        if self.trust_user_header and user_header.strip():
            return as_principal(user_header)
        raise errors.Unauthenticated(f"no credential: {HOW_TO_GET_A_TOKEN}")

    def _cached(self, secret: str) -> TokenRecord | None:
        """The token's record from this daemon's cache while fresh, else None; 401 when
        the cached record has expired."""
        now = self._clock()
        with self._lock:
            hit = self._cache.get(secret)
        if hit is None or now - hit[1] >= self.cache_s:
            return None
        record = hit[0]
        if record.expired():
            self.forget(record.token_id)
            raise errors.Unauthenticated(
                f"{ExpiredToken(record.token_id, record.expires_at)}; {HOW_TO_GET_A_TOKEN}"
            )
        return record

    def _lookup(self, secret: str) -> TokenRecord:
        cached = self._cached(secret)
        if cached is not None:
            return cached
        now = self._clock()
        if self.tokens is None:
            raise errors.Unauthenticated(f"this daemon has no token store; {HOW_TO_GET_A_TOKEN}")
        try:
            record = self.tokens.authenticate(secret)
        except (InvalidToken, RevokedToken, ExpiredToken) as exc:
            with self._lock:
                self._cache.pop(secret, None)
            raise errors.Unauthenticated(f"{exc}; {HOW_TO_GET_A_TOKEN}") from None
        except (pymongo.errors.PyMongoError, StoreUnavailable) as exc:
            raise errors.Unavailable(f"the token store is unavailable: {exc}") from None
        if self.cache_s > 0:
            with self._lock:
                if len(self._cache) >= MAX_CACHE_ENTRIES:
                    self._cache.clear()
                self._cache[secret] = (record, now)
        return record

    def forget(self, token_id: str) -> None:
        """Drop a token from this daemon's cache (after a revoke)."""
        with self._lock:
            for key in [k for k, (r, _) in self._cache.items() if r.token_id == token_id]:
                del self._cache[key]

    # -- token management (admins only) ----------------------------------------------------
    def _store(self, who: Principal) -> TokensRepository:
        if not who.is_admin:
            raise errors.PermissionDenied(
                f"{who.user} is not an admin; only an admin token can manage tokens"
            )
        if self.tokens is None:
            raise errors.Unavailable("this daemon has no token store")
        return self.tokens

    def create_token(
        self,
        who: Principal,
        user: str = "",
        role: str = "",
        expires_in_s: float = 0,
        description: str = "",
    ) -> tuple[TokenRecord, str]:
        """Create a token acting as `user` (default: the caller); returns it and its secret."""
        store = self._store(who)
        role = role or "user"
        if role not in ROLES:
            raise errors.BadRequest(f"role {role!r} is not one of {', '.join(ROLES)}")
        if expires_in_s < 0 or expires_in_s > MAX_TOKEN_LIFETIME_S:
            raise errors.BadRequest(
                f"expires_in_seconds must be between 0 (never) and {MAX_TOKEN_LIFETIME_S}"
            )
        expires_at = time.time() + expires_in_s if expires_in_s else 0.0
        try:
            created = store.create(
                user or who.user, role, expires_at, created_by=who.user, description=description
            )
        except BadTokenRequest as exc:
            raise errors.BadRequest(str(exc)) from None
        except (pymongo.errors.PyMongoError, StoreUnavailable) as exc:
            raise errors.Unavailable(f"the token store is unavailable: {exc}") from None
        return created.record, created.secret

    def list_tokens(self, who: Principal) -> list[TokenRecord]:
        store = self._store(who)
        try:
            return store.list()
        except (pymongo.errors.PyMongoError, StoreUnavailable) as exc:
            raise errors.Unavailable(f"the token store is unavailable: {exc}") from None

    def revoke_token(self, who: Principal, token_id: str) -> TokenRecord:
        store = self._store(who)
        try:
            record = store.revoke(token_id)
        except TokenNotFound as exc:
            raise errors.NotFound(str(exc)) from None
        except (pymongo.errors.PyMongoError, StoreUnavailable) as exc:
            raise errors.Unavailable(f"the token store is unavailable: {exc}") from None
        self.forget(token_id)
        return record


# -- the embedded platform's admin token ---------------------------------------------------
ADMIN_TOKEN_FILE = "admin.token"


def write_secret_file(path: Path, secret: str) -> None:
    """Write `secret` to `path` readable by its owner only (0600), created so from the
    first byte (never world-readable for an instant), and check the mode afterwards."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask cannot widen it, but be explicit
        os.write(fd, (secret + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode != 0o600:
        raise PermissionError(f"{path} has mode {mode:o}, not 600; refusing to keep a token there")


def ensure_admin_token_file(
    tokens: TokensRepository, path: Path, user: str = "", log: logging.Logger | None = None
) -> str:
    """Make sure `path` holds a working admin token for this store; return its token id.

    No file: create an admin token (acting as `user`, default the daemon's OS user) and
    write it 0600. A file whose token this store does not know (a fresh database): replace
    it. A revoked or expired one is left alone: an admin did that on purpose; delete the
    file and restart to get a new one."""
    log = log or logging.getLogger("rhizome.api")
    if path.exists():
        secret = path.read_text().strip()
        try:
            return tokens.authenticate(secret).token_id
        except (RevokedToken, ExpiredToken) as exc:
            log.warning(
                "the admin token in %s does not work (%s); delete it to get a new one", path, exc
            )
            return ""
        except InvalidToken:
            log.warning("the admin token in %s is unknown to this token store; replacing it", path)
    try:
        user = user or getpass.getuser()
    except (KeyError, OSError):  # no login name in this container
        user = ""
    created = tokens.create(
        user or "admin",
        "admin",
        created_by="rhizomed",
        description=f"local admin token ({path})",
    )
    write_secret_file(path, created.secret)
    log.info(
        "created admin token %s for %s in %s (mode 0600)",
        created.record.token_id,
        created.record.user,
        path,
    )
    return created.record.token_id


# -- logs ---------------------------------------------------------------------------------
_SECRETS = re.compile(r"(?i)(bearer\s+)\S+|rz_[A-Za-z0-9_-]{16,}")


def redact(text: str) -> str:
    """`Bearer <anything>`, anything shaped like a token secret, and the passwords of store
    URIs (`redact_uri`), replaced by `***`."""
    return redact_uri(_SECRETS.sub(lambda m: (m.group(1) or "") + "***", text))


class RedactingFilter(logging.Filter):
    """A log filter that keeps token secrets out of every line it passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


def install_log_redaction(logger: logging.Logger | None = None) -> None:
    """Redact secrets on every handler of `logger` (default: the root logger)."""
    target = logger or logging.getLogger()
    for handler in target.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
