"""The etcd wrapper: the only module that imports the etcd client (`pyetcd`).

Why `pyetcd` (the `etcd-sdk-python` package): it keeps the python-etcd3 API but ships
current generated code, so our own gRPC stubs stay on the fast protobuf implementation
(the old `etcd3` 0.12 needs `protobuf<4` or the pure-Python protobuf).

What the lifecycle needs from etcd, and nothing more:
- JSON values (`get`, `get_prefix`, `put`), each with its `mod_revision`, which is the
  fencing token of a compare-and-set (as `token` in torch.distributed.elastic's
  rendezvous `set_state(state, token)`);
- `create` (put if absent) and `cas` (put if unchanged since `mod_revision`);
- leases (`grant`, `keep_alive` in a background thread, `revoke`);
- prefix watches that call back on every change (`watch_prefix`).

Every call that cannot reach etcd raises `StoreUnavailable` naming the URL and what to do.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import grpc
import pyetcd
import pyetcd.exceptions

from services.store.errors import StoreUnavailable

log = logging.getLogger(__name__)

_UNREACHABLE: tuple[type[BaseException], ...] = (
    pyetcd.exceptions.ConnectionFailedError,
    pyetcd.exceptions.ConnectionTimeoutError,
    pyetcd.exceptions.NoServerAvailableError,
    grpc.RpcError,
)


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


class Lease:
    """An etcd lease kept alive by a daemon thread until `revoke` (or the process dies)."""

    def __init__(self, store: EtcdStore, lease_id: int, ttl: int) -> None:
        self.store = store
        self.id = lease_id
        self.ttl = ttl
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = threading.Event()

    def keep_alive(self, interval_s: float | None = None) -> Lease:
        period = interval_s if interval_s is not None else max(0.2, self.ttl / 4)

        def run() -> None:
            while not self._stop.wait(period):
                try:
                    responses = list(self.store.client.refresh_lease(self.id))
                    if responses and responses[-1].TTL <= 0:
                        self.lost.set()  # expired while we were away: the holder must stop
                        return
                except Exception:  # etcd away for a moment: try again next period
                    log.debug("lease %x refresh failed", self.id, exc_info=True)

        self._thread = threading.Thread(target=run, name=f"lease-{self.id:x}", daemon=True)
        self._thread.start()
        return self

    def revoke(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            self.store.client.revoke_lease(self.id)


class EtcdStore:
    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url
        host, port = parse_url(url)
        self.client = pyetcd.client(host=host, port=port, timeout=timeout_s)

    @classmethod
    def connect(cls, url: str, timeout_s: float = 5.0) -> EtcdStore:
        """A store whose server answered a status call, or StoreUnavailable."""
        store = cls(url, timeout_s)
        with store._errors("connect"):
            store.client.status()
        return store

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()

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
            value, meta = self.client.get(key)
        if value is None:
            return None
        return Entry(key, _decode(value), meta.mod_revision, meta.lease_id)

    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        with self._errors(f"get {prefix}*"):
            items = list(self.client.get_prefix(prefix))
        out = {}
        for value, meta in items:
            key = meta.key.decode()
            out[key] = Entry(key, _decode(value), meta.mod_revision, meta.lease_id)
        return out

    def revision(self) -> int:
        with self._errors("status"):
            resp = self.client.get_response("/")
        return int(resp.header.revision)

    # -- write ----------------------------------------------------------------------------
    def put(self, key: str, value: Any, lease: Lease | int | None = None) -> None:
        with self._errors(f"put {key}"):
            self.client.put(key, _encode(value), lease=_lease_id(lease))

    def create(self, key: str, value: Any, lease: Lease | int | None = None) -> bool:
        """Put only if the key does not exist; True if this call created it."""
        tx = self.client.transactions
        with self._errors(f"create {key}"):
            ok, _ = self.client.transaction(
                compare=[tx.create(key) == 0],
                success=[tx.put(key, _encode(value), lease=_lease_id(lease))],
                failure=[],
            )
        return bool(ok)

    def cas(
        self, key: str, value: Any, mod_revision: int, lease: Lease | int | None = None
    ) -> bool:
        """Put only if the key was last written at `mod_revision` (0: does not exist)."""
        tx = self.client.transactions
        with self._errors(f"cas {key}"):
            ok, _ = self.client.transaction(
                compare=[tx.mod(key) == mod_revision],
                success=[tx.put(key, _encode(value), lease=_lease_id(lease))],
                failure=[],
            )
        return bool(ok)

    def delete(self, key: str) -> None:
        with self._errors(f"delete {key}"):
            self.client.delete(key)

    def delete_if(self, key: str, mod_revision: int) -> bool:
        """Delete only if unchanged since `mod_revision`."""
        tx = self.client.transactions
        with self._errors(f"delete {key}"):
            ok, _ = self.client.transaction(
                compare=[tx.mod(key) == mod_revision], success=[tx.delete(key)], failure=[]
            )
        return bool(ok)

    def delete_prefix(self, prefix: str) -> None:
        with self._errors(f"delete {prefix}*"):
            self.client.delete_prefix(prefix)

    # -- leases ---------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> Lease:
        """A new lease (etcd rounds a TTL below its minimum, about 2 s, up to it)."""
        with self._errors("lease grant"):
            lease = self.client.lease(int(ttl_s))
        return Lease(self, int(lease.id), int(lease.ttl))

    def revoke(self, lease_id: int) -> None:
        """Revoke a lease by id (a supervisor does this for a holder it saw die)."""
        if not lease_id:
            return
        with contextlib.suppress(pyetcd.exceptions.Etcd3Exception, grpc.RpcError):
            self.client.revoke_lease(lease_id)

    # -- watches --------------------------------------------------------------------------
    def watch_prefix(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback()` (no arguments: re-read what you need) after every change
        under `prefix`, and also when the watch stream breaks, so the caller resyncs.
        Returns a function that cancels the watch."""

        def on_event(_: object) -> None:
            try:
                callback()
            except Exception:
                log.exception("watch callback for %s failed", prefix)

        with self._errors(f"watch {prefix}*"):
            watch_id = self.client.add_watch_prefix_callback(prefix, on_event)

        def cancel() -> None:
            with contextlib.suppress(Exception):
                self.client.cancel_watch(watch_id)

        return cancel


def _lease_id(lease: Lease | int | None) -> int | None:
    if lease is None:
        return None
    return lease.id if isinstance(lease, Lease) else int(lease)


def _encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
