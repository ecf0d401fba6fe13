"""How an etcd client gets and replaces its auth token (contract/etcd.py `_authenticate`,
`_refresh_token`), with a stand-in for etcd's Auth service: the timings these tests need
(an authentication that runs past its deadline, threads refused together) cannot be
produced on demand by a real etcd. tests/integration/test_security_etcd_auth.py runs the
same paths against a real one."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from contract import etcd, etcd_watch
from contract.etcd import EtcdClient, EtcdCredentials, StoreUnavailable
from contract.procs import free_port


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _AuthService:
    """Answers Authenticate with the errors it is given, in order, then with tokens."""

    def __init__(self, errors: list[_RpcError], delay_s: float = 0.0) -> None:
        self.errors = list(errors)
        self.delay_s = delay_s
        self.calls = 0
        self._lock = threading.Lock()

    def Authenticate(self, request: object, timeout: float) -> SimpleNamespace:
        with self._lock:
            self.calls += 1
            error = self.errors.pop(0) if self.errors else None
            number = self.calls
        time.sleep(self.delay_s)
        if error is not None:
            raise error
        return SimpleNamespace(token=f"token-{number}")


def _client(auth: _AuthService) -> EtcdClient:
    """A client of an etcd that is not there (nothing is called but `auth`), given
    credentials after construction so that its first token comes from `auth` too."""
    client = EtcdClient(f"http://127.0.0.1:{free_port()}", timeout_s=0.5, anonymous=True)
    client._credentials = EtcdCredentials("rhizome", "pw")
    client.raw._stubs["authstub"] = auth
    return client


def test_an_authentication_past_its_deadline_is_tried_again() -> None:
    """etcd checks a password again after every auth change applied meanwhile: while
    the LCM adds job users back to back, one authentication can outlast its deadline."""
    late = _RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    auth = _AuthService([late, late])
    client = _client(auth)
    client._authenticate()
    assert auth.calls == 3
    assert client.raw.metadata == (("token", "token-3"),)


def test_an_authentication_that_keeps_running_late_fails_naming_etcd() -> None:
    late = _RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    auth = _AuthService([late] * 10)
    client = _client(auth)
    with pytest.raises(StoreUnavailable, match="authenticate as rhizome"):
        client._authenticate()
    assert auth.calls == 4  # _AUTH_ATTEMPTS, not forever


def test_an_unreachable_etcd_is_not_asked_again() -> None:
    down = _RpcError(grpc.StatusCode.UNAVAILABLE, "connection refused")
    auth = _AuthService([down, down])
    client = _client(auth)
    with pytest.raises(StoreUnavailable, match="unreachable"):
        client._authenticate()
    assert auth.calls == 1


def test_threads_refused_the_same_token_get_one_new_token() -> None:
    """Every auth change refuses every token at once; eight threads of one client that
    were refused together must not cost etcd eight password checks."""
    auth = _AuthService([], delay_s=0.05)
    client = _client(auth)
    client._authenticate()
    refused = client._token_generation
    start = threading.Barrier(8)

    def refresh() -> None:
        start.wait()
        client._refresh_token(refused)

    threads = [threading.Thread(target=refresh) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert auth.calls == 2  # the first token and one replacement
    assert client.reauthentications == 1
    assert client.raw.metadata == (("token", "token-2"),)
    client._refresh_token(client._token_generation)  # a later refusal: a new token again
    assert auth.calls == 3


def test_a_call_refused_for_its_token_is_retried_with_new_tokens_then_fails_saying_why() -> None:
    auth = _AuthService([])
    client = _client(auth)
    client._authenticate()
    calls = 0

    def overtaken() -> None:
        nonlocal calls
        calls += 1
        raise _RpcError(grpc.StatusCode.UNKNOWN, "auth: revision in header is old")

    with pytest.raises(StoreUnavailable, match="for its auth token"):
        client._run("put /x", overtaken)
    assert calls == etcd._TOKEN_RETRIES + 1  # the call and its retries
    assert client.reauthentications == etcd._TOKEN_RETRIES  # a new token before each retry

    refused_once = iter([True])

    def lands_on_the_second_try() -> str:
        if next(refused_once, False):
            raise _RpcError(grpc.StatusCode.UNKNOWN, "auth: revision of auth store is old")
        return "done"

    assert client._run("put /y", lands_on_the_second_try) == "done"


def _overtaken_while(client: EtcdClient, token: str) -> object:
    """A call that etcd refuses as overtaken by an auth change while the client still
    sends `token`, and answers once it sends another."""

    def call() -> str:
        if client.raw.metadata == (("token", token),):
            raise _RpcError(grpc.StatusCode.UNKNOWN, "auth: revision in header is old")
        return "done"

    return call


def test_threads_refused_for_an_overtaken_token_share_one_pause_and_one_new_token() -> None:
    """Amid a burst of auth changes (the LCM's batch of job users) a token got at once
    would be overtaken again: the client's threads wait out one pause together and then
    share one new token."""
    auth = _AuthService([])
    client = _client(auth)
    client._authenticate()
    call = _overtaken_while(client, "token-1")
    start = threading.Barrier(8)
    results: list[object] = []

    def run() -> None:
        start.wait()
        results.append(client._run("get /x", call))  # type: ignore[arg-type]

    threads = [threading.Thread(target=run) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == ["done"] * 8
    assert auth.calls == 2 and client.reauthentications == 1
    assert client._overtaken_in_a_row == 1  # one pause, set by the first thread refused


def test_pauses_double_while_new_tokens_keep_being_overtaken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    auth = _AuthService([])
    client = _client(auth)
    client._authenticate()
    slept: list[float] = []
    monkeypatch.setattr(etcd.time, "sleep", slept.append)
    refusals = iter(range(6))

    def overtaken_six_times() -> str:
        if next(refusals, None) is not None:
            raise _RpcError(grpc.StatusCode.UNKNOWN, "auth: revision of auth store is old")
        return "done"

    assert client._run("put /x", overtaken_six_times) == "done"
    assert client.reauthentications == 6
    slept = [s for s in slept if s]  # (the stand-in's own sleep(0) is patched too)
    assert len(slept) == 6
    for i, pause in enumerate(slept):  # 10, 20, 40, 80 ms, then 100 ms at most, less a random part
        most = min(etcd._TOKEN_RETRY_MAX_PAUSE_S, etcd._TOKEN_RETRY_PAUSE_S * 2**i)
        spread = etcd._TOKEN_RETRY_PAUSE_S * min(i + 1, 4)  # each thread a little apart
        assert most / 2 - 0.005 <= pause <= most + spread


def test_a_lapsed_token_is_replaced_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A token etcd forgot (idle past its TTL) is not an auth change: no pause."""
    auth = _AuthService([])
    client = _client(auth)
    client._authenticate()
    slept: list[float] = []
    monkeypatch.setattr(etcd.time, "sleep", slept.append)
    lapsed = iter([True])

    def call() -> str:
        if next(lapsed, False):
            raise _RpcError(grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token")
        return "done"

    assert client._run("get /x", call) == "done"
    assert client.reauthentications == 1 and not any(slept)


def test_a_watch_started_amid_auth_changes_gets_new_tokens_not_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `PrefixWatch` makes three calls as it starts or re-establishes itself: the full
    read, the compaction check at its revision, and the watch. Each of them refused for
    an overtaken token must be retried with a new one, as every other call is (a guardian
    host died at start on "auth: revision in header is old" while the LCM added job
    users: those calls bypassed the client's retry)."""
    auth = _AuthService([])
    client = _client(auth)
    client._authenticate()
    monkeypatch.setattr(etcd.time, "sleep", lambda _s: None)  # the pauses between tokens
    called: list[str] = []

    def refused_once(name: str, answer: object) -> object:
        def call(*_args: object, **_kwargs: object) -> object:
            called.append(name)
            if called.count(name) == 1:
                raise _RpcError(grpc.StatusCode.UNKNOWN, "auth: revision in header is old")
            return answer

        return call

    kv = SimpleNamespace(key=b"/p/a", value=b"1", mod_revision=4)
    listing = SimpleNamespace(kvs=[kv], header=SimpleNamespace(revision=5))
    monkeypatch.setattr(client.raw, "get_prefix_response", refused_once("read", listing))
    monkeypatch.setattr(client.raw, "get_response", refused_once("check", None))
    monkeypatch.setattr(client.raw, "add_watch_prefix_callback", refused_once("watch", 7))
    delivered: list[tuple[list[etcd_watch.Change], bool]] = []
    watch = etcd_watch.PrefixWatch(
        client, "/p/", lambda changes, full: delivered.append((changes, full))
    )
    watch.start()
    try:
        assert called == ["read", "read", "check", "check", "watch", "watch"]
        assert client.reauthentications == 3  # a new token before each retry
        assert delivered == [([etcd_watch.Change("/p/a", 1, 4)], True)] and watch.revision == 5
        assert watch._watch_id == 7
    finally:
        monkeypatch.setattr(client.raw, "cancel_watch", lambda _id: None)
        watch.stop()
