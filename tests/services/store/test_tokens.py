"""TokensRepository against both real MongoDB-wire servers (SecantusDB and nx-27017):
only the hash is stored, lookups go through a unique index, typed errors."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import pytest

from services.store.tokens import (
    BadTokenRequest,
    ExpiredToken,
    InvalidToken,
    RevokedToken,
    TokenNotFound,
    TokensRepository,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def db(flavoured_db: Any) -> Any:
    return flavoured_db


@pytest.fixture
def repo(db: Any) -> TokensRepository:
    db["tokens"].delete_many({})
    repository = TokensRepository(db)
    repository.ensure_indexes()
    return repository


def test_the_secret_is_returned_once_and_only_its_hash_is_stored(
    repo: TokensRepository, db: Any
) -> None:
    created = repo.create("alice", "user", created_by="root", description="laptop")
    secret = created.secret
    assert secret.startswith("rz_") and len(secret) >= 3 + 43  # 32 random bytes, base64url
    doc = db["tokens"].find_one({"_id": created.record.token_id})
    assert doc["hash"] == hashlib.sha256(secret.encode()).hexdigest()
    stored = repr(doc)
    assert secret not in stored and secret[len("rz_") + 8 :] not in stored
    assert doc["prefix"] == secret[:7] and doc["user"] == "alice" and doc["role"] == "user"
    # Two tokens never share a secret.
    assert repo.create("alice").secret != secret


def test_authenticate_finds_the_token_by_its_secret(repo: TokensRepository) -> None:
    created = repo.create("bob", "admin")
    found = repo.authenticate(created.secret)
    assert (found.token_id, found.user, found.role) == (created.record.token_id, "bob", "admin")
    with pytest.raises(InvalidToken):
        repo.authenticate(created.secret + "x")
    with pytest.raises(InvalidToken, match="start with rz_"):
        repo.authenticate("Bearer nonsense")


def test_the_hash_lookup_is_a_unique_index(repo: TokensRepository, db: Any) -> None:
    indexes = db["tokens"].index_information()
    by_key = {tuple(k for k, _ in spec["key"]): spec for spec in indexes.values()}
    assert ("hash",) in by_key and by_key[("hash",)].get("unique") is True
    assert ("created_at",) in by_key


def test_list_never_shows_a_secret_or_a_hash(repo: TokensRepository) -> None:
    first = repo.create("carol")
    second = repo.create("dave", "admin")
    listed = repo.list()
    assert [t.token_id for t in listed] == [second.record.token_id, first.record.token_id]
    for token in listed:
        text = repr(token)
        assert first.secret not in text and second.secret not in text
        assert not hasattr(token, "hash")


def test_revoked_and_expired_tokens_are_refused_with_their_reason(
    repo: TokensRepository,
) -> None:
    revoked = repo.create("erin")
    record = repo.revoke(revoked.record.token_id)
    assert record.revoked and record.revoked_at > 0
    assert repo.revoke(revoked.record.token_id).revoked_at == record.revoked_at  # idempotent
    with pytest.raises(RevokedToken, match="revoked"):
        repo.authenticate(revoked.secret)
    expiring = repo.create("frank", expires_at=time.time() + 60)
    assert repo.authenticate(expiring.secret).user == "frank"
    with pytest.raises(ExpiredToken, match="expired at"):
        repo.authenticate(expiring.secret, now=time.time() + 120)
    with pytest.raises(TokenNotFound):
        repo.revoke("tok_missing")


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"user": ""}, "needs the user"),
        ({"user": "x" * 200}, "longer than"),
        ({"user": "gina", "role": "root"}, "not one of user, admin"),
        ({"user": "gina", "expires_at": 1.0}, "in the past"),
    ],
)
def test_bad_creates_are_refused(
    repo: TokensRepository, kwargs: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(BadTokenRequest, match=fragment):
        repo.create(**kwargs)
    assert repo.list() == []
