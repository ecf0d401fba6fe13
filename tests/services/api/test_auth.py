"""services/api/auth.py without servers: credential parsing, the lookup cache and its
bound, roles on token management, and secrets kept out of log lines."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from services.api import errors
from services.api.auth import (
    Authenticator,
    Principal,
    RedactingFilter,
    as_principal,
    bearer,
    redact,
)
from services.api.core import owner_scope
from services.store.tokens import InvalidToken, RevokedToken, TokenRecord


class FakeTokens:
    """The part of TokensRepository the authenticator uses, counting lookups."""

    def __init__(self) -> None:
        self.records: dict[str, TokenRecord] = {}
        self.revoked: set[str] = set()
        self.lookups = 0

    def add(self, secret: str, user: str, role: str = "user", expires_at: float = 0.0) -> None:
        self.records[secret] = TokenRecord(
            token_id=f"tok_{user}", user=user, role=role, prefix=secret[:7],
            created_at=time.time(), expires_at=expires_at,
        )  # fmt: skip

    def authenticate(self, secret: str) -> TokenRecord:
        self.lookups += 1
        record = self.records.get(secret)
        if record is None:
            raise InvalidToken("unknown token")
        if record.token_id in self.revoked:
            raise RevokedToken(record.token_id)
        return record


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(cache_s: float = 5.0, trust: bool = False) -> tuple[Authenticator, FakeTokens, Clock]:
    tokens, clock = FakeTokens(), Clock()
    tokens.add("rz_alice", "alice")
    tokens.add("rz_root", "root", "admin")
    auth = Authenticator(tokens, trust_user_header=trust, cache_s=cache_s, clock=clock)  # type: ignore[arg-type]
    return auth, tokens, clock


def test_bearer_parsing() -> None:
    assert bearer("") == "" and bearer(None) == ""
    assert bearer("Bearer rz_x") == "rz_x" and bearer("bearer   rz_x ") == "rz_x"
    for bad in ("Basic abc", "Bearer", "rz_x"):
        with pytest.raises(errors.Unauthenticated, match="malformed"):
            bearer(bad)


def test_a_token_resolves_to_its_principal_on_both_doors() -> None:
    auth, _, _ = make()
    assert auth.from_grpc([("authorization", "Bearer rz_alice")]) == Principal(
        "alice", "user", "tok_alice"
    )
    assert auth.from_http({"authorization": "Bearer rz_root"}).is_admin
    with pytest.raises(errors.Unauthenticated, match="rhizome token create"):
        auth.from_grpc([])
    with pytest.raises(errors.Unauthenticated, match="unknown token"):
        auth.from_http({"authorization": "Bearer rz_nobody"})


def test_the_user_header_counts_only_when_trusted_and_never_over_a_token() -> None:
    auth, _, _ = make()
    with pytest.raises(errors.Unauthenticated):
        auth.from_grpc([("x-rhizome-user", "mallory")])
    trusting, _, _ = make(trust=True)
    assert trusting.from_grpc([("x-rhizome-user", "mallory")]).user == "mallory"
    assert trusting.from_http({"X-Watson-Userinfo": "bluemix-instance-id=w1;x"}).user == "w1"
    both = trusting.from_http({"authorization": "Bearer rz_alice", "X-Rhizome-User": "root"})
    assert both == Principal("alice", "user", "tok_alice")


def test_valid_lookups_are_cached_for_the_bound_and_no_longer() -> None:
    auth, tokens, clock = make(cache_s=5.0)
    for _ in range(10):
        auth.resolve("Bearer rz_alice")
    assert tokens.lookups == 1
    tokens.revoked.add("tok_alice")  # revoked by another daemon
    clock.now += 4.9
    assert auth.resolve("Bearer rz_alice").user == "alice"  # still inside the bound
    clock.now += 0.2
    with pytest.raises(errors.Unauthenticated, match="revoked"):
        auth.resolve("Bearer rz_alice")


def test_without_lookup_answers_only_what_needs_no_token_store() -> None:
    auth, tokens, clock = make(cache_s=5.0)
    alice = {"authorization": "Bearer rz_alice"}
    assert auth.from_http_without_lookup(alice) is None  # not cached: only a lookup can tell
    assert tokens.lookups == 0
    auth.from_http(alice)  # the lookup (the gateway makes it off its event loop)
    assert auth.from_http_without_lookup(alice) == Principal("alice", "user", "tok_alice")
    assert tokens.lookups == 1
    clock.now += 5.1  # past the cache's bound: a lookup again
    assert auth.from_http_without_lookup(alice) is None
    with pytest.raises(errors.Unauthenticated, match="rhizome token create"):
        auth.from_http_without_lookup({})  # no credential at all: 401 at once
    with pytest.raises(errors.Unauthenticated, match="malformed"):
        auth.from_http_without_lookup({"authorization": "Basic abc"})
    trusting, _, _ = make(trust=True)
    assert trusting.from_http_without_lookup({"X-Rhizome-User": "mallory"}).user == "mallory"  # type: ignore[union-attr]


def test_a_cached_token_past_its_expiry_is_refused() -> None:
    auth, tokens, _ = make(cache_s=60.0)
    tokens.add("rz_short", "sam", expires_at=time.time() + 0.2)
    assert auth.resolve("Bearer rz_short").user == "sam"
    time.sleep(0.25)
    with pytest.raises(errors.Unauthenticated, match="expired"):
        auth.resolve("Bearer rz_short")


def test_forget_drops_a_revoked_token_from_the_cache_at_once() -> None:
    auth, tokens, _ = make()
    auth.resolve("Bearer rz_alice")
    tokens.revoked.add("tok_alice")
    auth.forget("tok_alice")
    with pytest.raises(errors.Unauthenticated, match="revoked"):
        auth.resolve("Bearer rz_alice")


def test_only_admins_manage_tokens() -> None:
    auth, _, _ = make()
    with pytest.raises(errors.PermissionDenied, match="not an admin"):
        auth.list_tokens(Principal("alice"))
    with pytest.raises(errors.BadRequest, match="expires_in_seconds"):
        auth.create_token(Principal("root", "admin"), "bob", "user", expires_in_s=-1)


def test_admins_are_unscoped_and_users_scoped_to_themselves() -> None:
    assert owner_scope(Principal("root", "admin")) is None
    assert owner_scope(Principal("alice")) == "alice"
    assert owner_scope("bob") == "bob"  # a bare id is a user, never an admin
    with pytest.raises(errors.Unauthenticated):
        as_principal("  ")


def test_secrets_are_redacted_from_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    secret = "rz_" + "Zx9-_" * 9
    assert redact(f"authorization: Bearer {secret}") == "authorization: Bearer ***"
    assert secret not in redact(f"got {secret} from the client")
    logger = logging.getLogger("test-redaction")
    handler_filter = RedactingFilter()
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler: Any = Keep()
    handler.addFilter(handler_filter)
    logger.addHandler(handler)
    try:
        logger.warning("call with %s failed", f"Bearer {secret}")
    finally:
        logger.removeHandler(handler)
    assert records == ["call with Bearer *** failed"]
