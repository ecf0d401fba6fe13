"""The rendezvous store of pipeline jobs on the platform: a torch.distributed.Store in
etcd that gloo builds real process groups from (real etcd)."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from learner.runtime.etcd_store import EtcdStore
from services.embedded.process import ManagedServer

pytestmark = pytest.mark.integration


def test_gloo_builds_a_group_from_it_under_a_prefix(etcd_server: ManagedServer) -> None:
    job = f"t-{uuid.uuid4().hex[:8]}"
    out: dict[int, list[float]] = {}

    def rank(r: int) -> None:
        store = EtcdStore(etcd_server.url, job)
        group = dist.ProcessGroupGloo(
            dist.PrefixStore("gen0/link0-1", store), r, 2, timedelta(seconds=20)
        )
        x = torch.full((3,), float(r + 1))
        group.allreduce([x]).wait()  # type: ignore[attr-defined]
        out[r] = x.tolist()
        store.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert out == {0: [3.0, 3.0, 3.0], 1: [3.0, 3.0, 3.0]}


def test_store_operations(etcd_server: ManagedServer) -> None:
    store = EtcdStore(etcd_server.url, f"t-{uuid.uuid4().hex[:8]}")
    try:
        store.set("a", b"\x00\xffbytes")
        assert store.get("a") == b"\x00\xffbytes"
        assert store.add("n", 2) == 2 and store.add("n", 3) == 5
        assert store.compare_set("k", "", "v") == b"v"
        assert store.compare_set("k", "x", "w") == b"v"  # not expected: unchanged
        assert store.compare_set("k", "v", "w") == b"w"
        assert store.check(["a", "k"]) and not store.check(["missing"])
        assert store.num_keys() == 3
        assert store.delete_key("a") and not store.check(["a"])
        with pytest.raises(RuntimeError, match="timed out"):
            store.wait(["missing"], timedelta(seconds=0.2))
    finally:
        store.close()
