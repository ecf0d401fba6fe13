from __future__ import annotations

import time
import uuid

import pytest

from learner.runtime.api import ConfigError
from learner.runtime.cluster_state import (
    ClusterState,
    ClusterStateStore,
    EtcdClusterStateStore,
    InMemoryClusterStateStore,
    initial_state,
)
from services.embedded.process import ManagedServer


def _check_fencing(a: ClusterStateStore, b: ClusterStateStore) -> None:
    state = initial_state(a, 3, 2)
    assert state.generation == 0
    _, token = a.get_state()
    # two reporters read the same token; only the first write wins
    assert a.set_state(state.bump(dead=(1,)), token)
    assert not b.set_state(state.bump(dead=(4,)), token)
    now, token2 = b.get_state()
    assert now is not None and now.dead == (1,) and now.generation == 1
    assert token2 != token
    assert b.set_state(now.bump(dead=(1, 4)), token2)


def test_in_memory_compare_and_set_is_fenced() -> None:
    shared = InMemoryClusterStateStore()
    _check_fencing(shared.view(), shared.view())


def test_initial_state_rejects_a_different_shape() -> None:
    store = InMemoryClusterStateStore()
    initial_state(store, 2, 1)
    with pytest.raises(ConfigError, match="2 stages x 1 pipelines"):
        initial_state(store.view(), 3, 1)


def test_in_memory_lease_expiry_removes_member() -> None:
    shared = InMemoryClusterStateStore()
    a, b = shared.view(), shared.view()
    a.register(0, ttl_s=60)
    b.register(1, ttl_s=60)
    assert a.alive_members() == {0, 1}
    shared.expire(1)
    assert a.alive_members() == {0}


def test_values_must_stay_small() -> None:
    with pytest.raises(ConfigError, match="< 1 KB"):
        InMemoryClusterStateStore().put("big", {"x": "y" * 2000})


def test_state_round_trips_through_json() -> None:
    s = ClusterState(3, 4, 2, dead=(1, 5), fatal="x", fatal_pipeline=0, fatal_stages=(1, 2))
    assert ClusterState.from_json(s.to_json()) == s


@pytest.mark.integration
def test_etcd_compare_and_set_is_fenced(etcd_server: ManagedServer) -> None:
    job = f"test-{uuid.uuid4().hex[:8]}"
    a = EtcdClusterStateStore(etcd_server.url, job)
    b = EtcdClusterStateStore(etcd_server.url, job)
    try:
        _check_fencing(a, b)
    finally:
        a.delete_all()
        a.close()
        b.close()


@pytest.mark.integration
def test_etcd_lease_marks_liveness_and_expires(etcd_server: ManagedServer) -> None:
    job = f"test-{uuid.uuid4().hex[:8]}"
    a = EtcdClusterStateStore(etcd_server.url, job)
    b = EtcdClusterStateStore(etcd_server.url, job)
    try:
        a.register(0, ttl_s=2)
        b.register(1, ttl_s=2)
        assert a.alive_members() == {0, 1}
        b.close()  # revokes: like a clean exit
        assert a.alive_members() == {0}
        a.record_failure(0, 1, "Connection closed by peer", step=3)
        assert a.get("failures/0-1") is not None
        assert a.get_prefix("failures/")["failures/0-1"]["suspect"] == 1
        c = EtcdClusterStateStore(etcd_server.url, job)
        c.register(2, ttl_s=2)
        c._lease = None  # stop refreshing without revoking: what a SIGKILL leaves behind
        deadline = time.monotonic() + 15
        while 2 in a.alive_members() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert 2 not in a.alive_members()
        c.close()
    finally:
        a.delete_all()
        a.close()
