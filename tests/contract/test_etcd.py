"""The etcd wrapper against a real etcd."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from contract.etcd import EtcdClient, parse_url
from contract.procs import free_port
from services.embedded.process import ManagedServer
from services.store.errors import StoreUnavailable
from tests.tcp_relay import Relay


@pytest.mark.integration
def test_create_cas_lease_and_watch(etcd_server: ManagedServer) -> None:
    store = EtcdClient.connect(etcd_server.url)
    prefix = f"/test/{uuid.uuid4().hex}/"
    changed = threading.Event()
    cancel = store.watch_prefix(prefix, changed.set)
    try:
        assert store.create(prefix + "a", {"n": 1})
        assert not store.create(prefix + "a", {"n": 2})
        entry = store.get(prefix + "a")
        assert entry is not None and entry.value == {"n": 1}
        assert store.cas(prefix + "a", {"n": 3}, entry.mod_revision)
        assert not store.cas(prefix + "a", {"n": 4}, entry.mod_revision)  # stale token
        assert changed.wait(5)
        lease = store.grant(2).keep_alive()
        store.put(prefix + "b", "held", lease)
        assert store.get_prefix(prefix)[prefix + "b"].lease == lease.id
        lease.revoke()
        assert store.get(prefix + "b") is None  # revoking the lease took its key
        store.delete_prefix(prefix)
        assert store.get_prefix(prefix) == {}
    finally:
        cancel()
        store.close()


@pytest.mark.integration
def test_put_if_held_writes_only_for_the_keys_holder(etcd_server: ManagedServer) -> None:
    """The fence of a lease holder: absent key, another lease's key and a lapsed holder's
    write are refused; the holder's write lands, with or without its lease attached."""
    store = EtcdClient.connect(etcd_server.url)
    key = f"/test/{uuid.uuid4().hex}/held"
    ours, theirs = store.grant(5), store.grant(5)
    lost: list[int] = []
    try:
        assert not store.put_if_held(key, "v0", holder=ours, lease=ours)  # absent
        assert store.create(key, "v1", lease=ours)
        assert store.put_if_held(key, "v2", holder=ours, lease=ours)
        entry = store.get(key)
        assert entry is not None and (entry.value, entry.lease) == ("v2", ours.id)
        store.put(key, "theirs", lease=theirs)  # a successor took the key
        assert not store.put_if_held(key, "v3", holder=ours, lease=ours)
        entry = store.get(key)
        assert entry is not None and (entry.value, entry.lease) == ("theirs", theirs.id)
        # A final write detaches the key from the holder's lease (it outlives it).
        assert store.put_if_held(key, "final", holder=theirs, lease=None)
        entry = store.get(key)
        assert entry is not None and (entry.value, entry.lease) == ("final", 0)
        # keep_alive's on_lost: called once when a refresh finds the lease gone
        watched = store.grant(2)
        watched.keep_alive(interval_s=0.2, on_lost=lambda: lost.append(watched.id))
        store.revoke(watched.id)
        deadline = time.monotonic() + 10
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost == [watched.id] and watched.lost.is_set()
    finally:
        ours.revoke()
        theirs.revoke()
        store.delete(key)
        store.close()


def test_unreachable_etcd_is_a_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(
        StoreUnavailable, match=f"etcd at {url} is unreachable.*rhizome up --embedded"
    ):
        EtcdClient.connect(url, timeout_s=1)


def test_bad_urls_say_what_is_expected() -> None:
    assert parse_url("127.0.0.1:2379") == ("127.0.0.1", 2379)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_url("http://nohost")
    with pytest.raises(ValueError, match="--etcd"):
        parse_url("")


@pytest.mark.integration
def test_a_lease_outlives_repeated_cuts_shorter_than_its_ttl(etcd_server: ManagedServer) -> None:
    """Each cut of the connection is shorter than the lease's TTL, and the keep-alive
    tries all through it; so the lease must survive them all. gRPC's default reconnect
    backoff (1 s, then 1.6x per failed attempt) used to hold the channel closed for up
    to a second after etcd came back, and two or three cuts in a row let the lease lapse
    (issue #24: both pipeline workers then declared each other dead)."""
    relay = Relay(etcd_server.port)
    client = EtcdClient(f"http://127.0.0.1:{relay.port}", timeout_s=1)
    direct = EtcdClient(etcd_server.url)
    key = f"/t-{uuid.uuid4().hex[:8]}/held"
    lease = client.grant(2)
    try:
        client.put(key, 1, lease)
        lease.keep_alive(0.2)
        for _ in range(6):
            relay.cut()
            time.sleep(0.5)
            relay.restore()
            time.sleep(0.5)
        time.sleep(0.5)
        assert not lease.lost.is_set(), "etcd answered that the lease had expired"
        assert direct.get(key) is not None, "the lease lapsed during the cuts"
    finally:
        lease.revoke()
        client.close()
        direct.close()
        relay.close()
