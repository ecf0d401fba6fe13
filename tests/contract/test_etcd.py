"""The etcd wrapper against a real etcd."""

from __future__ import annotations

import threading
import uuid

import pytest

from contract.etcd import EtcdClient, parse_url
from contract.procs import free_port
from services.embedded.process import ManagedServer
from services.store.errors import StoreUnavailable


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
