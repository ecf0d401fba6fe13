"""The one etcd client wrapper, for the platform and the learners: with
`contract.etcd_watch` (`PrefixWatch`: every change under a prefix, across disconnects) and
`contract.etcd_users` (etcd's users and roles: authentication, each job's own user) the
only modules that import the etcd client (`pyetcd`). How an etcd server is started is
`contract.etcd_server`.

Why `pyetcd` (the `etcd-sdk-python` package): it keeps the python-etcd3 API but ships
current generated code, so our own gRPC stubs stay on the fast protobuf implementation
(the old `etcd3` 0.12 needs `protobuf<4` or the pure-Python protobuf).

What the two sides need from etcd, and nothing more:
- JSON values (`get`, `get_prefix`, `put`), each with its `mod_revision`, which is the
  fencing token of a compare-and-set (as `token` in torch.distributed.elastic's
  rendezvous `set_state(state, token)`);
- `create` (put if absent) and `cas` (put if unchanged since `mod_revision`; 0: absent);
- leases (`grant`; `Lease.keep_alive` in a background thread for the platform and the
  controller, `Lease.refresh` from the pipeline runtime's own loop, so a hung worker
  loses its lease; both send over one kept keep-alive stream per lease; `revoke`);
- watches of one key or a prefix that call back on every change (`watch`, `watch_prefix`);
  `contract.etcd_watch.PrefixWatch` delivers the changes themselves, in order, across
  disconnects (resumed from the last revision it delivered; a compacted revision gives one
  full re-read).

Every call that cannot reach etcd raises `StoreUnavailable` naming the URL and what to do.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import random
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlparse

import grpc
import pyetcd
import pyetcd.events
import pyetcd.exceptions
import pyetcd.transactions
import pyetcd.utils

from contract.credentials import redact_uri

log = logging.getLogger(__name__)
T = TypeVar("T")

_UNREACHABLE: tuple[type[BaseException], ...] = (
    pyetcd.exceptions.ConnectionFailedError,
    pyetcd.exceptions.ConnectionTimeoutError,
    pyetcd.exceptions.NoServerAvailableError,
    grpc.RpcError,
)


# gRPC waits 1 s after a failed connection attempt, then 1.6x longer after each further
# one (to 120 s); a client whose keep-alive tried all through a cut of etcd thus stayed
# cut off up to a second after etcd was back, and two or three short cuts in a row let a
# 2-3 s lease lapse (issue #24). Retrying a local etcd every 0.1-0.5 s costs a refused
# connection each. Not `grpc.min_reconnect_backoff_ms`: gRPC core reads it as the *minimum
# connect timeout* (20 s by default), so at 100 ms every connection attempt had to finish
# its TCP and HTTP/2 handshake within 0.1-0.5 s, and on a loaded machine a worker's first
# call failed with "connection attempt timed out before receiving SETTINGS frame".
_CHANNEL = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


class StoreUnavailable(RuntimeError):
    """A store cannot be reached; the message names which and where. The platform raises
    it for MongoDB too (services/store/errors.py re-exports it), so one `except` serves."""


@dataclass(frozen=True)
class Entry:
    """A key's JSON value and the revision it was last written at (the CAS token)."""

    key: str
    value: Any
    mod_revision: int
    lease: int


def parse_url(url: str) -> tuple[str, int]:
    """`http://127.0.0.1:2379` (or `127.0.0.1:2379`) -> (host, port)."""
    if not url:
        raise ValueError("no etcd URL: pass --etcd http://HOST:PORT or set RHIZOME_ETCD")
    parsed = urlparse(url if "://" in url else f"http://{url}")
    if not parsed.hostname or not parsed.port:
        raise ValueError(f"etcd URL {redact_uri(url)!r} is not http://HOST:PORT")
    return parsed.hostname, parsed.port


# The query parameter naming the CA file that verifies an https:// etcd (MongoDB's name
# for the same thing, so every store URL reads alike); it travels with the URL to the
# guardians and the learners.
TLS_CA_PARAM = "tlsCAFile"


def tls_ca_file(url: str) -> str:
    """The CA file for an `https://` etcd URL (its `?tlsCAFile=`, else the system's CA
    bundle); "" for `http://`. An https URL is never quietly spoken to in plaintext."""
    parsed = urlparse(url if "://" in url else f"http://{url}")
    if parsed.scheme == "http":
        return ""
    if parsed.scheme != "https":
        raise ValueError(f"etcd URL {redact_uri(url)!r}: the scheme must be http or https")
    ca = parse_qs(parsed.query).get(TLS_CA_PARAM, [""])[0]
    if ca:
        if not Path(ca).is_file():
            raise ValueError(f"etcd URL {redact_uri(url)!r}: the CA file {ca} does not exist")
        return ca
    # Imported here: the offline learner image's Python has no libssl, and a learner only
    # needs it for an https etcd without a CA file of its own.
    import ssl

    system = ssl.get_default_verify_paths()
    for candidate in (system.cafile, system.openssl_cafile):
        if candidate and Path(candidate).is_file():
            return candidate
    raise ValueError(
        f"etcd URL {redact_uri(url)!r} is https but names no CA and this system has no CA bundle; "
        f"add ?{TLS_CA_PARAM}=/path/to/ca.pem"
    )


class _KeepAliveStream:
    """One long-lived `LeaseKeepAlive` stream of one lease: a refresh is one request and
    its answer on it, not a new streaming call each time.

    etcd's LeaseKeepAlive is a bidirectional stream meant to stay open; the client
    library opens a new one per refresh (`refresh_lease`), and setting up and tearing
    down a gRPC stream (HTTP/2 stream, authentication, a goroutine in etcd) costs etcd
    several times what one keep-alive message on an open stream does. The answers are
    read by a thread of this stream, so a refresh waits for its answer at most
    `timeout_s` (a stalled etcd must not hang the caller's loop).
    """

    def __init__(self, client: EtcdClient, lease_id: int) -> None:
        raw = client.raw
        self._request = pyetcd.etcdrpc.LeaseKeepAliveRequest(ID=lease_id)
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.broken = False
        # no deadline: the stream lives as long as the lease is kept
        self._call = raw.leasestub.LeaseKeepAlive(
            iter(self._requests.get, None),
            credentials=raw.call_credentials,
            metadata=raw.metadata,
        )
        self._reader = threading.Thread(
            target=self._read, name=f"lease-stream-{lease_id:x}", daemon=True
        )
        self._reader.start()

    def _read(self) -> None:
        try:
            for answer in self._call:
                self._answers.put(answer)
            self._answers.put(
                pyetcd.exceptions.ConnectionFailedError("the keep-alive stream ended")
            )
        except grpc.RpcError as exc:
            self._answers.put(exc)

    def refresh(self, timeout_s: float) -> int:
        """Send one keep-alive and return the TTL etcd answered (<= 0: the lease is gone).

        Raises what broke the stream (`grpc.RpcError`, `ConnectionFailedError`), or
        `ConnectionTimeoutError` when etcd did not answer in time; the stream is then
        closed and the next refresh opens a new one.
        """
        self._requests.put(self._request)
        try:
            answer = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            self.close()
            raise pyetcd.exceptions.ConnectionTimeoutError(
                f"no keep-alive answer within {timeout_s:g} s"
            ) from None
        if isinstance(answer, BaseException):
            self.close()
            raise answer
        return int(answer.TTL)

    def close(self) -> None:
        self.broken = True
        self._requests.put(None)  # ends the request iterator
        with contextlib.suppress(Exception):
            self._call.cancel()


class Lease:
    """An etcd lease; `keep_alive` refreshes it from a daemon thread until `revoke` (or
    the process dies), `refresh` once from the caller's own loop. Refreshes go over one
    kept keep-alive stream (`_KeepAliveStream`), reopened when it breaks."""

    def __init__(self, client: EtcdClient, lease_id: int, ttl: int) -> None:
        self.client = client
        self.id = lease_id
        self.ttl = ttl
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = threading.Event()
        self._stream: _KeepAliveStream | None = None
        self._stream_lock = threading.Lock()
        self.streams_opened = 0  # keep-alive streams opened so far (tests, logs)

    def refresh(self) -> bool:
        """Refresh once; False when the lease had already expired (the holder must stop)."""
        with self._stream_lock, self.client._errors(f"lease {self.id:x} refresh"):
            if self._stream is None or self._stream.broken:
                self._stream = _KeepAliveStream(self.client, self.id)
                self.streams_opened += 1
            ttl = self._stream.refresh(self.client.timeout_s)
        if ttl <= 0:
            self.lost.set()
            return False
        return True

    def keep_alive(
        self, interval_s: float | None = None, on_lost: Callable[[], None] | None = None
    ) -> Lease:
        """Refresh from a daemon thread every `interval_s` (a quarter of the TTL); when a
        refresh finds the lease expired, `lost` is set and `on_lost()` called (from that
        thread), so a holder learns it at once instead of polling `lost`."""
        period = interval_s if interval_s is not None else max(0.2, self.ttl / 4)

        def run() -> None:
            while not self._stop.wait(period):
                try:
                    alive = self.refresh()
                except Exception:  # etcd away for a moment: try again next period
                    log.debug("lease %x refresh failed", self.id, exc_info=True)
                    continue
                if not alive:  # expired while we were away: the holder must stop or regain
                    if on_lost is not None and not self._stop.is_set():
                        on_lost()
                    return

        self._thread = threading.Thread(target=run, name=f"lease-{self.id:x}", daemon=True)
        self._thread.start()
        return self

    def revoke(self) -> None:
        self._stop.set()
        # not under the stream lock: a refresh waiting for a stalled etcd holds it
        stream = self._stream
        if stream is not None:
            stream.close()
        with contextlib.suppress(Exception):
            self.client.raw.revoke_lease(self.id)


class EtcdAuthError(StoreUnavailable):
    """etcd refused the caller: no credentials where it requires them, a wrong password,
    or a key outside the user's role. A StoreUnavailable, so every caller's existing
    `except` still catches it; the message says which and what to do."""


# What etcd answers a caller it does not accept (codes and its own messages).
_AUTH_CODES = {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED}
_AUTH_MESSAGES = ("user name is empty", "authentication failed", "invalid auth token")


# etcd refused the call before doing anything, for the token it carried: it lapsed
# (simple tokens expire after `--auth-token-ttl` idle, 300 s by default), or an auth change
# (a job's user added or removed: the LCM does it for every job) was applied between the
# call's permission check and its apply ("auth: revision in header is old"; etcd's Go
# client retries both with a fresh token, `shouldRefreshToken`).
_RETRY_WITH_NEW_TOKEN = (
    "invalid auth token",
    "revision in header is old",
    "revision of auth store is old",
)


# A call refused for its token is tried again with a new one this many times. A token
# that lapsed is replaced at once. One overtaken by an auth change is replaced after a
# pause (EtcdClient._wait_out_auth_changes), doubled each time a token is overtaken again
# (from _TOKEN_RETRY_PAUSE_S up to _TOKEN_RETRY_MAX_PAUSE_S, less a random part): the LCM
# makes job users' auth changes in bursts (services/lcm/setup.py), a burst refuses every
# token it overtakes, and a busy client (4 threads) that re-authenticated at once was
# refused again a few changes later: ~70 new tokens in one burst of 200 users; 16 with
# pauses of up to 0.1 s, 8 with 0.5 s (benchmarks/RESULTS.md, session 10). Pauses of
# 0.5 s held the guardian hosts' deploys back until the bursts were over. 20 retries wait ~1.5 s in all, longer than a burst of MAX_BATCH set-ups lasts
# (benchmarks/etcd_auth_churn.py: 3 retries without pauses failed a few calls in every
# round).
_TOKEN_RETRIES = 20
_TOKEN_RETRY_PAUSE_S = 0.01
_TOKEN_RETRY_MAX_PAUSE_S = 0.1
# A token overtaken this long after the last one was starts the pauses over: a new burst.
_QUIET_AFTER_S = 0.3
_AUTH_ATTEMPTS = 4
# What etcd says when an auth change overtook the call (its token's auth revision is old).
_OVERTAKEN = ("revision in header is old", "revision of auth store is old")


def _token_refused(exc: BaseException | None) -> bool:
    """Whether etcd refused `exc`'s call for its token, not for what it asked."""
    if not isinstance(exc, grpc.RpcError):
        return False
    details = str(exc.details() or "")
    return any(m in details for m in _RETRY_WITH_NEW_TOKEN)


def _overtaken(exc: BaseException | None) -> bool:
    """Whether `exc`'s call was refused because an auth change overtook its token."""
    return isinstance(exc, grpc.RpcError) and any(m in str(exc.details() or "") for m in _OVERTAKEN)


def _token_retry_pause(in_a_row: int) -> float:
    """The pause before a new token, when `in_a_row` tokens were overtaken before."""
    pause = min(_TOKEN_RETRY_MAX_PAUSE_S, _TOKEN_RETRY_PAUSE_S * 2**in_a_row)
    return random.uniform(pause / 2, pause)


def _auth_refusal(exc: BaseException) -> str:
    """etcd's own reason when `exc` is a refusal of the caller's identity; else ''."""
    if not isinstance(exc, grpc.RpcError):
        return ""
    code, details = exc.code(), str(exc.details() or "")
    if code in _AUTH_CODES or any(m in details for m in _AUTH_MESSAGES):
        return details or str(code)
    return ""


@dataclass(frozen=True)
class EtcdCredentials:
    """An etcd user and its password (never in `repr`, never on a command line): what a
    client authenticates with when etcd runs with authentication enabled."""

    user: str
    password: str = field(repr=False)

    @classmethod
    def from_file(cls, path: Path) -> EtcdCredentials:
        """`USER:PASSWORD` from `path`, which must be readable by its owner alone."""
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            raise ValueError(
                f"{path} holds an etcd password but has mode {mode:o}: chmod 600 {path}"
            )
        try:
            return cls.parse(path.read_text())
        except ValueError:
            raise ValueError(f"{path} must hold USER:PASSWORD on one line") from None

    @classmethod
    def parse(cls, text: str) -> EtcdCredentials:
        """From `USER:PASSWORD` (the file's line, and how a learner spec carries them)."""
        user, sep, password = text.strip().partition(":")
        if not sep or not user or not password:
            raise ValueError("etcd credentials must be USER:PASSWORD")
        return cls(user, password)

    def line(self) -> str:
        """`USER:PASSWORD`, the inverse of `parse` (a secret: never print it)."""
        return f"{self.user}:{self.password}"

    def write(self, path: Path) -> None:
        """Store as `USER:PASSWORD`, mode 0600 from the first byte."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(self.line() + "\n")
        os.replace(tmp, path)


# etcd's superuser, which only the LCM holds (to make and remove each job's etcd user);
# a platform-only variable, so it is not in contract/env.py's learner contract. The
# platform's own clients name theirs in `env.ETCD_CREDENTIALS_FILE`.
ETCD_ROOT_CREDENTIALS_FILE = "RHIZOME_ETCD_ROOT_CREDENTIALS_FILE"


def _credentials_named_by(variable: str) -> EtcdCredentials | None:
    """The credentials in the file `$variable` names; None when it is unset. A file that
    is missing, unreadable, readable by others or malformed is an EtcdAuthError naming
    the variable and the fix: a client must not quietly fall back to no identity."""
    path = os.environ.get(variable, "")
    if not path:
        return None
    try:
        return EtcdCredentials.from_file(Path(path))
    except OSError as exc:
        raise EtcdAuthError(
            f"${variable} names {path}, which cannot be read ({exc.strerror or exc}); "
            "point it at the platform's etcd credentials file (`rhizome up` writes "
            "<data dir>/etcd-auth/) or unset it for an etcd without authentication"
        ) from None
    except ValueError as exc:
        raise EtcdAuthError(f"${variable}: {exc}") from None


def credentials_from_env() -> EtcdCredentials | None:
    """The etcd user this process authenticates as: the file `$RHIZOME_ETCD_CREDENTIALS_FILE`
    names (contract/env.py), or None (etcd without authentication)."""
    from contract.env import ETCD_CREDENTIALS_FILE

    return _credentials_named_by(ETCD_CREDENTIALS_FILE)


def root_credentials_from_env() -> EtcdCredentials | None:
    """etcd's root user, from the file `$RHIZOME_ETCD_ROOT_CREDENTIALS_FILE` names (the
    daemon hosting the LCM, under `rhizome up`); None where it is not given."""
    return _credentials_named_by(ETCD_ROOT_CREDENTIALS_FILE)


class EtcdClient:
    """JSON values, compare-and-set, leases and watches on one etcd endpoint; with
    `credentials`, as that etcd user (etcd with authentication enabled).

    Without `credentials` the client takes the user of the file
    `$RHIZOME_ETCD_CREDENTIALS_FILE` names, when set (`credentials_from_env`): that is how
    every etcd client of the platform and of a learner authenticates without its call
    site knowing. `anonymous=True` ignores it (enabling authentication on a fresh etcd)."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 5.0,
        credentials: EtcdCredentials | None = None,
        *,
        anonymous: bool = False,
    ) -> None:
        if credentials is None and not anonymous:
            credentials = credentials_from_env()
        self.url = url
        self.timeout_s = timeout_s
        self._credentials = credentials
        self.reauthentications = 0  # times an expired auth token was replaced
        self._token_lock = threading.Lock()
        self._token_generation = 0  # bumped by each new token; see _refresh_token
        # Pausing amid a burst of auth changes (_wait_out_auth_changes): the token whose
        # refusal set the pause, when the next token is got, how many tokens in a row were
        # overtaken (the pause doubles with it) and when the last one was.
        self._paused_generation = -1
        self._retry_at = 0.0
        self._overtaken_in_a_row = 0
        self._overtaken_at = 0.0
        host, port = parse_url(url)
        ca = tls_ca_file(url)
        user = credentials.user if credentials else None
        # The library would authenticate in its constructor, once, with no retry; this
        # client authenticates itself (`_authenticate`), so that the first token is got the
        # same way as every later one.
        self.raw = pyetcd.client(
            host=host, port=port, timeout=timeout_s, ca_cert=ca or None, grpc_options=_CHANNEL
        )
        if credentials is not None:
            try:
                self._authenticate()
            except EtcdAuthError as exc:
                reason = _auth_refusal(exc.__cause__) if exc.__cause__ else ""
                raise EtcdAuthError(
                    f"etcd at {redact_uri(url)} refused user {user!r} ({reason}): check the "
                    "password in the platform's etcd credentials file"
                ) from exc.__cause__
        if credentials is not None and not self.raw.uses_secure_channel:
            # gRPC refuses call credentials on a plaintext channel; the library sends the
            # same etcd token in each call's metadata too, which is what etcd reads.
            self.raw.call_credentials = None
        # The library marks an endpoint that answered UNAVAILABLE as failed and refuses
        # every call to it for 300 s, a rule for switching between several endpoints. With
        # one endpoint that turns an etcd restart of a second into five minutes without
        # etcd; gRPC reconnects the channel by itself, so let the next call try.
        for endpoint in self.raw.endpoints.values():
            endpoint.time_retry = 0.0

    @classmethod
    def connect(
        cls, url: str, timeout_s: float = 5.0, credentials: EtcdCredentials | None = None
    ) -> EtcdClient:
        """A client whose server answered a status call, or StoreUnavailable (credentials
        as for the constructor)."""
        client = cls(url, timeout_s, credentials)
        with client._errors("connect"):
            client.raw.status()
        return client

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.raw.close()

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except _UNREACHABLE as exc:
            reason = _auth_refusal(exc)
            if reason:
                raise EtcdAuthError(
                    f"etcd at {redact_uri(self.url)} refused {what} ({reason}): it requires "
                    "authentication; give the client the platform's etcd credentials "
                    "(EtcdCredentials) of a user whose role covers the key"
                ) from exc
            raise StoreUnavailable(
                f"etcd at {redact_uri(self.url)} is unreachable ({what}: {type(exc).__name__}); start it "
                "with `rhizome up --embedded` or point --etcd / RHIZOME_ETCD at a running one"
            ) from exc

    def _run(self, what: str, call: Callable[[], T]) -> T:
        """`call()` with etcd's errors translated (`_errors`); when etcd refused the call's
        token (`_token_refused`: it lapsed, or an auth change overtook the call),
        authenticate again and retry, a few times (auth changes can keep overtaking calls
        while the LCM adds many jobs' users: after a pause, `_token_retry_pause`). A retry
        is safe: etcd refused the call before doing anything. A client authenticates again
        only when a call of its own was refused (never ahead of one), and its threads
        refused the same token share one new token (`_refresh_token`)."""
        for attempt in range(_TOKEN_RETRIES + 1):
            generation = self._token_generation
            try:
                with self._errors(what):
                    return call()
            except StoreUnavailable as exc:  # EtcdAuthError included
                if self._credentials is None or not _token_refused(exc.__cause__):
                    raise
                if attempt == _TOKEN_RETRIES:
                    raise StoreUnavailable(
                        f"etcd at {redact_uri(self.url)} refused {what} {attempt + 1} times "
                        "for its auth token, each new token overtaken by another auth change "
                        "(job users added or removed back to back); try again"
                    ) from exc.__cause__
                if _overtaken(exc.__cause__):
                    self._wait_out_auth_changes(generation)
            self._refresh_token(generation)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _wait_out_auth_changes(self, refused_generation: int) -> None:
        """Pause before replacing a token an auth change overtook: amid a burst of them (the
        LCM's batches of job users) a token got at once would be overtaken again a few
        changes later. The client's threads share one pause per token (the first thread
        refused it sets when the next token is got), doubled each time a token is
        overtaken again, until none was for `_QUIET_AFTER_S` (`_token_retry_pause`): calls
        do get through between two changes of a burst, so that does not mean it ended."""
        with self._token_lock:
            if self._token_generation == refused_generation != self._paused_generation:
                now = time.monotonic()
                if now - self._overtaken_at > _QUIET_AFTER_S:
                    self._overtaken_in_a_row = 0  # a new burst
                self._paused_generation = refused_generation
                self._retry_at = now + _token_retry_pause(self._overtaken_in_a_row)
                self._overtaken_in_a_row += 1
                self._overtaken_at = now
            retry_at = self._retry_at
            spread = _TOKEN_RETRY_PAUSE_S * min(self._overtaken_in_a_row, 4)
        # Each thread a little later than the shared moment: hundreds of threads of one
        # client (a host's guardians and simulated learners) must not call etcd at once.
        delay = retry_at + random.uniform(0, spread) - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def _refresh_token(self, refused_generation: int) -> None:
        """A new token in place of the one of `refused_generation`, which etcd refused.
        Threads of this client that were refused the same token together get one new
        token, not one each: every auth change refuses every token at once, and each
        authentication costs etcd a password hash."""
        with self._token_lock:
            if self._token_generation == refused_generation:
                self._authenticate()
                self.reauthentications += 1

    def _authenticate(self) -> None:
        """A fresh auth token for every later call (and watch) of this client.

        etcd answers an authentication only once no auth change (a job's user added or
        removed) was applied while it checked the password; it checks again after each
        one, so while the LCM adds users back to back one authentication can take
        seconds and run past its deadline. Such an attempt is tried again, up to
        `_AUTH_ATTEMPTS` in all: a busy etcd is not an unreachable one."""
        from pyetcd import etcdrpc
        from pyetcd.client import EtcdTokenCallCredentials

        assert self._credentials is not None
        request = etcdrpc.AuthenticateRequest(
            name=self._credentials.user, password=self._credentials.password
        )
        for attempt in range(_AUTH_ATTEMPTS):
            try:
                with self._errors(f"authenticate as {self._credentials.user}"):
                    token = self.raw.authstub.Authenticate(request, self.raw.timeout).token
                break
            except StoreUnavailable as exc:
                cause = exc.__cause__
                if (
                    attempt == _AUTH_ATTEMPTS - 1
                    or not isinstance(cause, grpc.RpcError)
                    or cause.code() != grpc.StatusCode.DEADLINE_EXCEEDED
                ):
                    raise
        self.raw.metadata = (("token", token),)
        if self.raw.uses_secure_channel:
            self.raw.call_credentials = grpc.metadata_call_credentials(
                EtcdTokenCallCredentials(token)
            )
        watcher = self.raw._stubs.get("watcher")
        if watcher is not None:  # it copied the old token when it was made
            watcher._metadata = self.raw.metadata
            watcher._credentials = self.raw.call_credentials
        self._token_generation += 1

    # -- read -----------------------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        value, meta = self._run(f"get {key}", lambda: self.raw.get(key))
        if value is None:
            return None
        return Entry(key, decode(value), int(meta.mod_revision), int(meta.lease_id))

    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        items = self._run(f"get {prefix}*", lambda: list(self.raw.get_prefix(prefix)))
        out = {}
        for value, meta in items:
            key = meta.key.decode()
            out[key] = Entry(key, decode(value), int(meta.mod_revision), int(meta.lease_id))
        return out

    def get_many(self, keys: Iterable[str] = (), prefixes: Iterable[str] = ()) -> dict[str, Entry]:
        """Every entry of `keys` and under each of `prefixes`, in one call: a transaction of
        range reads, one round trip (and one revision) for what a `get` per key and a
        `get_prefix` per prefix read in one call each. By key; an absent key is left out."""
        keys, prefixes = list(keys), list(prefixes)
        tx = self.raw.transactions
        reads = [tx.get(key) for key in keys] + [
            tx.get(prefix, range_end=pyetcd.utils.prefix_range_end(prefix.encode()))
            for prefix in prefixes
        ]
        _, answers = self._run(
            f"get {' '.join([*keys, *(f'{p}*' for p in prefixes)])}",
            lambda: self.raw.transaction(compare=[], success=reads, failure=[]),
        )
        out = {}
        for items in answers:
            for value, meta in items:
                key = meta.key.decode()
                out[key] = Entry(key, decode(value), int(meta.mod_revision), int(meta.lease_id))
        return out

    def revision(self) -> int:
        """The store's current revision. Asked of the Status call, which any authenticated
        user may make: a read of a key would need a role covering that key."""
        from pyetcd import etcdrpc

        resp = self._run(
            "status",
            lambda: self.raw.maintenancestub.Status(
                etcdrpc.StatusRequest(),
                self.raw.timeout,
                credentials=self.raw.call_credentials,
                metadata=self.raw.metadata,
            ),
        )
        return int(resp.header.revision)

    # -- write ----------------------------------------------------------------------------
    def put(self, key: str, value: Any, lease: Lease | int | None = None) -> None:
        self._run(f"put {key}", lambda: self.raw.put(key, encode(value), lease=_lease_id(lease)))

    def _put_if(
        self, what: str, key: str, compare: Any, value: Any, lease: Lease | int | None
    ) -> bool:
        """Put `value` (under `lease`) in one transaction only if `compare` holds; True
        if it did. What `create`, `cas` and `put_if_held` each are, with its own compare."""
        tx = self.raw.transactions
        ok, _ = self._run(
            f"{what} {key}",
            lambda: self.raw.transaction(
                compare=[compare],
                success=[tx.put(key, encode(value), lease=_lease_id(lease))],
                failure=[],
            ),
        )
        return bool(ok)

    def create(self, key: str, value: Any, lease: Lease | int | None = None) -> bool:
        """Put only if the key does not exist; True if this call created it."""
        return self._put_if("create", key, self.raw.transactions.create(key) == 0, value, lease)

    def cas(
        self, key: str, value: Any, mod_revision: int, lease: Lease | int | None = None
    ) -> bool:
        """Put only if the key was last written at `mod_revision` (0: does not exist)."""
        compare = self.raw.transactions.mod(key) == mod_revision
        return self._put_if("cas", key, compare, value, lease)

    def put_if_held(
        self, key: str, value: Any, holder: Lease | int, lease: Lease | int | None = None
    ) -> bool:
        """Put only if the key exists and is held by the lease `holder` (its lease id);
        the put attaches `lease` (None: no lease, so the value outlives the holder). The
        fence of a lease holder that may have lost its key without knowing: a lease that
        lapsed while its keep-alive thread was starved, and a successor that took the key
        since. An absent key compares as lease 0, so it fails too."""
        holder_id = _lease_id(holder) or 0
        if not holder_id:
            return False
        return self._put_if("put-if-held", key, _LeaseOf(key) == holder_id, value, lease)

    def delete(self, key: str) -> None:
        self._run(f"delete {key}", lambda: self.raw.delete(key))

    def delete_if(self, key: str, mod_revision: int) -> bool:
        """Delete only if unchanged since `mod_revision`."""
        tx = self.raw.transactions
        ok, _ = self._run(
            f"delete {key}",
            lambda: self.raw.transaction(
                compare=[tx.mod(key) == mod_revision], success=[tx.delete(key)], failure=[]
            ),
        )
        return bool(ok)

    def delete_prefix(self, prefix: str) -> None:
        self._run(f"delete {prefix}*", lambda: self.raw.delete_prefix(prefix))

    # -- leases ---------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> Lease:
        """A new lease (etcd rounds a TTL below its minimum, about 2 s, up to it)."""
        lease = self._run("lease grant", lambda: self.raw.lease(int(ttl_s)))
        return Lease(self, int(lease.id), int(lease.ttl))

    def revoke(self, lease_id: int) -> None:
        """Revoke a lease by id (a supervisor does this for a holder it saw die)."""
        if not lease_id:
            return
        with contextlib.suppress(pyetcd.exceptions.Etcd3Exception, grpc.RpcError):
            self.raw.revoke_lease(lease_id)

    # -- watches --------------------------------------------------------------------------
    def watch_prefix(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback()` (no arguments: re-read what you need) after every change
        under `prefix`, and also when the watch stream breaks, so the caller resyncs.
        Returns a function that cancels the watch."""
        return self._watch(prefix, callback, prefix=True)

    def watch(self, key: str, callback: Callable[[], None]) -> Callable[[], None]:
        """As `watch_prefix`, for one key."""
        return self._watch(key, callback, prefix=False)

    def _watch(self, key: str, callback: Callable[[], None], *, prefix: bool) -> Callable[[], None]:
        def on_event(_: object) -> None:
            try:
                callback()
            except Exception:
                log.exception("watch callback for %s failed", key)

        add = self.raw.add_watch_prefix_callback if prefix else self.raw.add_watch_callback
        watch_id = self._run(f"watch {key}{'*' if prefix else ''}", lambda: add(key, on_event))

        def cancel() -> None:
            with contextlib.suppress(Exception):
                self.raw.cancel_watch(watch_id)

        return cancel


class _LeaseOf(pyetcd.transactions.BaseCompare):  # type: ignore[misc]
    """etcd's LEASE compare target (a key's lease id; 0 for none or an absent key), which
    pyetcd's `transactions` lacks (it has value, version, create and mod)."""

    def build_compare(self, compare: Any) -> None:
        compare.target = pyetcd.etcdrpc.Compare.LEASE
        compare.lease = int(self.value)


def _lease_id(lease: Lease | int | None) -> int | None:
    if lease is None:
        return None
    return lease.id if isinstance(lease, Lease) else int(lease)


def encode(value: Any) -> bytes:
    """How every value is stored: compact, key-sorted JSON (callers check sizes on it)."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def decode(raw: bytes) -> Any:
    """A stored value back: its JSON, else its text (a key some other tool wrote)."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
