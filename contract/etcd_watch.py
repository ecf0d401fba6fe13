"""Every change under an etcd key prefix, in order, across disconnects and compactions.

`PrefixWatch` is how the platform's guardians and LCM and the pipeline runtime follow a
prefix without polling: one full read, then a watch from the next revision, resumed after a
broken stream from the last revision it delivered, and read again in full when that
revision has been compacted. Every call it makes goes through `EtcdClient._run`, the
client's one place for expired-token retries and error translation.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pyetcd
import pyetcd.events
import pyetcd.exceptions

from contract.etcd import EtcdClient, decode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Change:
    """One key's change under a watched prefix: its new JSON value, or its deletion."""

    key: str
    value: Any  # None when deleted
    mod_revision: int
    deleted: bool = False


class PrefixWatch:
    """Every change under `prefix`, delivered in order to `on_change(changes, full)`.

    `start()` reads the prefix once (`full=True`: `changes` is every key there, as puts)
    at revision R and watches from R+1; then each watch response calls `on_change` with
    its changes (`full=False`). When the stream breaks (etcd restarted, the connection
    cut), a thread of this watch re-watches from the last delivered revision + 1, so a
    change made while it was away still arrives, once; when that revision has been
    compacted, it reads the prefix again (`full=True`) and watches from there. Changes to
    keys outside `prefix` are dropped. `on_change` runs in the client's watch thread: it
    must be quick (set an event, update a dict).
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        on_change: Callable[[list[Change], bool], None],
        retry_s: float = 0.2,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.on_change = on_change
        self.retry_s = retry_s
        self.revision = 0  # the last revision delivered
        self.reconnects = 0  # how often the stream was re-established (tests, logs)
        self.full_reads = 0
        self._lock = threading.Lock()
        self._watch_id: int | None = None
        self._broken = threading.Event()
        self._compacted = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PrefixWatch:
        """Read the prefix and watch it; raises `StoreUnavailable` if etcd is unreachable."""
        self._full_read()
        self._subscribe()
        self._thread = threading.Thread(target=self._keep, name=f"watch-{self.prefix}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._broken.set()
        with self._lock:
            watch_id, self._watch_id = self._watch_id, None
        if watch_id is not None:
            with contextlib.suppress(Exception):
                self.client.raw.cancel_watch(watch_id)

    # Every call of the watch goes through the client's `_run`, as every other call does:
    # an auth change (a job's etcd user added or removed) refuses every token, and a
    # watch re-established or started in that moment must get a new one, not fail (a
    # guardian host used to die at start on "auth: revision in header is old").
    def _full_read(self) -> None:
        resp = self.client._run(
            f"get {self.prefix}*", lambda: self.client.raw.get_prefix_response(self.prefix)
        )
        changes = [
            Change(kv.key.decode(), decode(kv.value), int(kv.mod_revision)) for kv in resp.kvs
        ]
        with self._lock:
            self.revision = int(resp.header.revision)
            self.full_reads += 1
        self.on_change(changes, True)

    def _subscribe(self) -> None:
        with self._lock:
            since = self.revision
        self._check_not_compacted(since)
        watch_id = self.client._run(
            f"watch {self.prefix}*",
            lambda: self.client.raw.add_watch_prefix_callback(
                self.prefix, self._on_response, start_revision=since + 1
            ),
        )
        with self._lock:
            self._watch_id = int(watch_id)

    def _check_not_compacted(self, revision: int) -> None:
        """Raise `RevisionCompactedError` if `revision` is gone.

        Asked with a read at that revision, because the client library answers a watch
        created on a compacted revision only after its whole timeout.
        """

        def read() -> None:
            try:
                self.client.raw.get_response(self.prefix, revision=revision)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.OUT_OF_RANGE:  # "required revision ... compacted"
                    raise pyetcd.exceptions.RevisionCompactedError(revision) from exc
                raise

        self.client._run(f"get {self.prefix}* at revision {revision}", read)

    def _on_response(self, resp: Any) -> None:
        if resp is None or isinstance(resp, BaseException):
            # the stream ended (None or an RpcError) or its revision was compacted
            self._compacted = isinstance(resp, pyetcd.exceptions.RevisionCompactedError)
            self._broken.set()
            return
        changes: list[Change] = []
        with self._lock:
            delivered = self.revision
            for event in resp.events:
                rev = int(event.mod_revision)
                if rev <= delivered:
                    continue  # delivered before the stream broke
                self.revision = max(self.revision, rev)
                key = event.key.decode()
                if not key.startswith(self.prefix):
                    continue
                deleted = isinstance(event, pyetcd.events.DeleteEvent)
                changes.append(Change(key, None if deleted else decode(event.value), rev, deleted))
        if changes:
            self.on_change(changes, False)

    def _keep(self) -> None:
        """Re-establish the watch whenever the stream breaks, until `stop`."""
        while not self._stop.is_set():
            self._broken.wait()
            if self._stop.is_set():
                return
            self._broken.clear()
            with self._lock:
                self._watch_id = None
            while not self._stop.is_set():
                try:
                    if self._compacted:
                        self._full_read()
                        self._compacted = False
                    self._subscribe()
                    self.reconnects += 1
                    break
                except pyetcd.exceptions.RevisionCompactedError:
                    self._compacted = True
                except Exception:  # etcd still away: try again shortly
                    log.debug("re-watching %s failed", self.prefix, exc_info=True)
                    self._stop.wait(self.retry_s)
