"""The tokens repository: the only code that reads and writes the `tokens` collection.

A token's secret is `rz_` + 32 random bytes (urlsafe base64). It is returned once, by
`create`, and never stored: the record keeps its SHA-256 hash (the lookup key, a unique
index) and a short public id for listing and revoking. Whoever reads the collection
cannot call the API with what they find there.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import Any

import pymongo
import pymongo.errors
from pymongo.database import Database

from services.store.errors import StoreError
from services.store.retry import with_retries

SECRET_PREFIX = "rz_"
ROLES = ("user", "admin")
MAX_USER_LENGTH = 128
MAX_DESCRIPTION_LENGTH = 256
# Shown in listings next to the id: enough to tell tokens apart, useless to call with.
SHOWN_PREFIX_CHARS = len(SECRET_PREFIX) + 4


class TokenError(StoreError):
    """Base class of the token store's refusals."""


class InvalidToken(TokenError):
    """No token has this secret (mistyped, never issued, or from another platform)."""


class RevokedToken(TokenError):
    def __init__(self, token_id: str) -> None:
        super().__init__(f"token {token_id} was revoked")
        self.token_id = token_id


class ExpiredToken(TokenError):
    def __init__(self, token_id: str, expired_at: float) -> None:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expired_at))
        super().__init__(f"token {token_id} expired at {when}")
        self.token_id = token_id


class TokenNotFound(TokenError, LookupError):
    def __init__(self, token_id: str) -> None:
        super().__init__(f"no token {token_id!r} (see `rhizome token list`)")
        self.token_id = token_id


class BadTokenRequest(TokenError, ValueError):
    """A create with a bad user, role or expiry; the message says which."""


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


@dataclass
class TokenRecord:
    token_id: str
    user: str
    role: str
    prefix: str  # the secret's first characters, for people telling tokens apart
    created_at: float
    created_by: str = ""
    description: str = ""
    expires_at: float = 0.0  # 0: never
    revoked_at: float = 0.0  # 0: not revoked

    def expired(self, now: float | None = None) -> bool:
        return (
            bool(self.expires_at) and (now if now is not None else time.time()) >= self.expires_at
        )

    @property
    def revoked(self) -> bool:
        return bool(self.revoked_at)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> TokenRecord:
        known = set(cls.__dataclass_fields__)
        data = {k: v for k, v in doc.items() if k in known}
        data["token_id"] = doc["_id"]
        return cls(**data)


@dataclass
class CreatedToken:
    record: TokenRecord
    secret: str  # the only time the secret exists outside its holder


class TokensRepository:
    """Tokens in MongoDB. Every query below is served by one of the indexes in `ensure_indexes`."""

    def __init__(self, db: Database[Any]) -> None:
        self._col = db["tokens"]

    @with_retries
    def ensure_indexes(self) -> None:
        # authentication: one indexed lookup by the secret's hash
        self._col.create_index("hash", unique=True)
        # listing, newest first
        self._col.create_index([("created_at", pymongo.DESCENDING)])

    # -- create -----------------------------------------------------------------------
    def create(
        self,
        user: str,
        role: str = "user",
        expires_at: float = 0.0,
        created_by: str = "",
        description: str = "",
    ) -> CreatedToken:
        user = (user or "").strip()
        if not user:
            raise BadTokenRequest("a token needs the user it acts as")
        if len(user) > MAX_USER_LENGTH:
            raise BadTokenRequest(f"user id longer than {MAX_USER_LENGTH} characters")
        if role not in ROLES:
            raise BadTokenRequest(f"role {role!r} is not one of {', '.join(ROLES)}")
        if len(description) > MAX_DESCRIPTION_LENGTH:
            raise BadTokenRequest(f"description longer than {MAX_DESCRIPTION_LENGTH} characters")
        now = time.time()
        if expires_at and expires_at <= now:
            raise BadTokenRequest("the expiry is in the past")
        secret = new_secret()
        record = TokenRecord(
            token_id="tok_" + secrets.token_hex(6),
            user=user,
            role=role,
            prefix=secret[:SHOWN_PREFIX_CHARS],
            created_at=now,
            created_by=created_by,
            description=description,
            expires_at=float(expires_at or 0.0),
        )
        doc = {**record.__dict__, "_id": record.token_id, "hash": hash_secret(secret)}
        del doc["token_id"]
        self._insert(doc)
        return CreatedToken(record, secret)

    @with_retries
    def _insert(self, doc: dict[str, Any]) -> None:
        try:
            self._col.insert_one(doc)
        except pymongo.errors.AutoReconnect:
            # The insert may have landed before the connection dropped.
            if self._col.find_one({"_id": doc["_id"]}, {"_id": 1}) is None:
                raise

    # -- read -------------------------------------------------------------------------
    @with_retries
    def _by_hash(self, digest: str) -> dict[str, Any] | None:
        return self._col.find_one({"hash": digest})

    def authenticate(self, secret: str, now: float | None = None) -> TokenRecord:
        """The token a secret belongs to, or InvalidToken / RevokedToken / ExpiredToken."""
        if not secret.startswith(SECRET_PREFIX) or len(secret) > 128:
            raise InvalidToken("not a Rhizome token (they start with rz_)")
        doc = self._by_hash(hash_secret(secret))
        if doc is None:
            raise InvalidToken("unknown token")
        record = TokenRecord.from_doc(doc)
        if record.revoked:
            raise RevokedToken(record.token_id)
        if record.expired(now):
            raise ExpiredToken(record.token_id, record.expires_at)
        return record

    @with_retries
    def get(self, token_id: str) -> TokenRecord:
        doc = self._col.find_one({"_id": token_id}, {"hash": 0})
        if doc is None:
            raise TokenNotFound(token_id)
        return TokenRecord.from_doc(doc)

    @with_retries
    def list(self, include_revoked: bool = True) -> list[TokenRecord]:
        """Every token, newest first; never a secret or a hash."""
        query: dict[str, Any] = {} if include_revoked else {"revoked_at": 0.0}
        cursor = self._col.find(query, {"hash": 0}).sort("created_at", pymongo.DESCENDING)
        return [TokenRecord.from_doc(d) for d in cursor]

    # -- change -----------------------------------------------------------------------
    @with_retries
    def revoke(self, token_id: str, now: float | None = None) -> TokenRecord:
        """Mark a token revoked (kept for the audit trail); revoking twice is a no-op."""
        self._col.update_one(
            {"_id": token_id, "revoked_at": 0.0},
            {"$set": {"revoked_at": now if now is not None else time.time()}},
        )
        return self.get(token_id)
