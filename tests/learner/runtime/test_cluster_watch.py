"""The watcher's view of a job's runtime keys, fed by an etcd watch (issue #24).

Against a real etcd; the forced disconnect is a real one: the watch's client reaches etcd
through a TCP relay in this test, which the test cuts (every connection closed, new ones
refused) and restores, while a second client writes straight to etcd.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from contract import etcd_keys
from contract.etcd import Change, EtcdClient, PrefixWatch
from learner.runtime.cluster_state import (
    ClusterState,
    EtcdClusterStateStore,
    InMemoryClusterStateStore,
)
from learner.runtime.cluster_watch import ClusterView
from services.embedded.process import ManagedServer

pytestmark = pytest.mark.integration


class Relay:
    """127.0.0.1:<port> -> etcd, bytes both ways, until ``cut()``; ``restore()`` reopens."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open = True
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open:
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.open = False
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def restore(self) -> None:
        self.open = True

    def close(self) -> None:
        self.cut()
        self.listener.close()


@pytest.fixture
def relay(etcd_server: ManagedServer) -> Iterator[Relay]:
    r = Relay(etcd_server.port)
    yield r
    r.close()


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.02)


class Recorder:
    def __init__(self) -> None:
        self.batches: list[tuple[list[Change], bool]] = []
        self.lock = threading.Lock()

    def __call__(self, changes: list[Change], full: bool) -> None:
        with self.lock:
            self.batches.append((changes, full))

    def keys(self, full: bool | None = None) -> list[str]:
        with self.lock:
            return [c.key for cs, f in self.batches if full in (None, f) for c in cs]

    def fulls(self) -> int:
        with self.lock:
            return sum(1 for _, f in self.batches if f)


def test_watch_resumes_after_a_forced_disconnect_and_sees_the_change_made_meanwhile(
    etcd_server: ManagedServer, relay: Relay
) -> None:
    prefix = f"/t-{uuid.uuid4().hex[:8]}/"
    direct = EtcdClient(etcd_server.url)
    watched = EtcdClient(f"http://127.0.0.1:{relay.port}", timeout_s=3)
    got = Recorder()
    watch = PrefixWatch(watched, prefix, got, retry_s=0.05).start()
    try:
        direct.put(prefix + "members/0", 0)
        wait_for(lambda: prefix + "members/0" in got.keys(full=False), "first change seen")
        relay.cut()
        direct.put(prefix + "members/1", 1)  # while the watcher is cut off
        direct.delete(prefix + "members/0")
        time.sleep(0.3)  # the change really happens while the stream is down
        relay.restore()
        wait_for(lambda: prefix + "members/1" in got.keys(full=False), "change made meanwhile")
        wait_for(lambda: got.keys(full=False).count(prefix + "members/0") == 2, "the deletion")
        assert watch.reconnects >= 1
        assert got.fulls() == 1, "a resumed watch needs no full re-read"
        assert got.keys(full=False).count(prefix + "members/1") == 1, "delivered once"
    finally:
        watch.stop()
        watched.close()
        direct.close()


def test_a_compacted_revision_gives_one_full_re_read(
    etcd_server: ManagedServer, relay: Relay
) -> None:
    prefix = f"/t-{uuid.uuid4().hex[:8]}/"
    direct = EtcdClient(etcd_server.url)
    watched = EtcdClient(f"http://127.0.0.1:{relay.port}", timeout_s=3)
    got = Recorder()
    watch = PrefixWatch(watched, prefix, got, retry_s=0.05).start()
    try:
        direct.put(prefix + "state", {"generation": 0})
        wait_for(lambda: prefix + "state" in got.keys(full=False), "first change seen")
        relay.cut()
        direct.put(prefix + "members/7", 7)
        for i in range(3):  # history the compaction removes
            direct.put(prefix + "state", {"generation": i + 1})
        direct.raw.compact(direct.revision())
        relay.restore()
        wait_for(lambda: got.fulls() == 2, "a full re-read")
        full = [c for cs, f in got.batches if f for c in cs][-2:]
        assert {c.key: c.value for c in full} == {
            prefix + "state": {"generation": 3},
            prefix + "members/7": 7,
        }
        # and it watches again from there
        direct.put(prefix + "members/8", 8)
        wait_for(lambda: prefix + "members/8" in got.keys(full=False), "a change after it")
        assert got.fulls() == 2
    finally:
        watch.stop()
        watched.close()
        direct.close()


def test_changes_of_another_jobs_prefix_are_not_delivered(etcd_server: ManagedServer) -> None:
    job, other = f"j-{uuid.uuid4().hex[:8]}", f"j-{uuid.uuid4().hex[:8]}"
    store = EtcdClusterStateStore(etcd_server.url, job)
    direct = EtcdClient(etcd_server.url)
    view = ClusterView()
    cancel = store.watch(view.apply)
    try:
        # the other job's members and a newer state, then one of ours to sync on
        direct.put(etcd_keys.runtime_prefix(other) + "members/5", 5)
        direct.put(
            etcd_keys.runtime_prefix(other) + "state",
            ClusterState(generation=9, stages=2, pipelines=1).to_dict(),
        )
        store.put("partition", {"boundaries": [0, 1, 2]})
        store.register(1, 2)
        wait_for(lambda: 1 in view.snapshot().members, "our own member")
        snap = view.snapshot()
        assert snap.members == {1}
        assert snap.state is None
    finally:
        cancel()
        store.close()
        direct.close()


def test_a_stale_generation_is_ignored_not_applied() -> None:
    view = ClusterView()
    newer = ClusterState(generation=2, stages=2, pipelines=1, dead=(1,))
    older = ClusterState(generation=1, stages=2, pipelines=1)
    view.apply([Change("state", newer.to_dict(), 10)], False)
    view.apply([Change("state", older.to_dict(), 11)], False)
    view.apply([Change("state", "not json of a state", 12)], False)
    assert view.snapshot().state == newer
    assert len(view.ignored) == 2 and "stale state of generation 1" in view.ignored[0]


def test_a_member_lost_then_full_re_read_is_still_known_as_seen() -> None:
    view = ClusterView()
    view.apply([Change("members/0", 0, 1), Change("members/1", 1, 1)], True)
    view.apply([Change("members/1", None, 2, deleted=True)], False)
    view.apply([Change("members/0", 0, 1)], True)  # after a compaction
    snap = view.snapshot()
    assert snap.members == {0}
    assert snap.seen == {0, 1}, "a worker that vanished during the gap is still missed"


def test_in_memory_store_delivers_the_same_changes() -> None:
    shared = InMemoryClusterStateStore()
    a, b = shared.view(), shared.view()
    view = ClusterView()
    a.register(0, 2)
    cancel = b.watch(view.apply)
    b.register(1, 2)
    a.set_state(ClusterState(generation=0, stages=2, pipelines=1), 0)
    a.put("done/0/0", {"step": 3})
    shared.expire(1)
    cancel()
    snap = view.snapshot()
    assert snap.members == {0} and snap.seen == {0, 1}
    assert snap.state is not None and snap.state.generation == 0
    assert snap.done == {0: frozenset({0})}
