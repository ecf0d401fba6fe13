"""The watcher's view of a job's runtime keys, fed by an etcd watch, and the lease's
keep-alive stream (issue #24).

Against a real etcd; the forced disconnect is a real one: the watch's client reaches etcd
through a TCP relay in this test, which the test cuts (every connection closed, new ones
refused) or stalls (connections kept, no byte forwarded) and restores, while a second
client writes straight to etcd.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

from contract import etcd_keys
from contract.etcd import EtcdClient
from contract.etcd_watch import Change, PrefixWatch
from learner.runtime.api import Batch, RedundancyMode
from learner.runtime.cluster_state import (
    ClusterState,
    EtcdClusterStateStore,
    InMemoryClusterStateStore,
)
from learner.runtime.cluster_watch import ClusterView
from learner.runtime.engine import Worker, WorkerOptions
from learner.runtime.reference import reference_train
from learner.runtime.toy import toy_batch, toy_job
from services.embedded.process import ManagedServer
from services.store.errors import StoreUnavailable
from tests.tcp_relay import Relay

pytestmark = pytest.mark.integration


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


@dataclass
class Watched:
    prefix: str  # a fresh one
    direct: EtcdClient  # writes straight to etcd
    got: Recorder  # what the watch delivered
    watch: PrefixWatch  # of `prefix`, through the relay


@pytest.fixture
def watched(etcd_server: ManagedServer, relay: Relay) -> Iterator[Watched]:
    direct = EtcdClient(etcd_server.url)
    client = EtcdClient(f"http://127.0.0.1:{relay.port}", timeout_s=3)
    prefix, got = f"/t-{uuid.uuid4().hex[:8]}/", Recorder()
    watch = PrefixWatch(client, prefix, got, retry_s=0.05).start()
    try:
        yield Watched(prefix, direct, got, watch)
    finally:
        watch.stop()
        client.close()
        direct.close()


def test_watch_resumes_after_a_forced_disconnect_and_sees_the_change_made_meanwhile(
    relay: Relay, watched: Watched
) -> None:
    prefix, direct, got, watch = watched.prefix, watched.direct, watched.got, watched.watch
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


def test_a_compacted_revision_gives_one_full_re_read(relay: Relay, watched: Watched) -> None:
    prefix, direct, got = watched.prefix, watched.direct, watched.got
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


def test_lease_refreshes_go_over_one_kept_keep_alive_stream(etcd_server: ManagedServer) -> None:
    client = EtcdClient(etcd_server.url)
    key = f"/t-{uuid.uuid4().hex[:8]}/held"
    lease = client.grant(2)
    try:
        client.put(key, 1, lease)
        for _ in range(12):  # 3 s in all: longer than the TTL, so the refreshes kept it
            assert lease.refresh()
            time.sleep(0.25)
        assert client.get(key) is not None, "the lease expired although it was refreshed"
        assert lease.streams_opened == 1, "a new keep-alive stream per refresh"
    finally:
        lease.revoke()
        client.close()


def test_a_cut_or_stalled_keep_alive_stream_fails_that_refresh_and_the_next_reopens_it(
    etcd_server: ManagedServer, relay: Relay
) -> None:
    client = EtcdClient(f"http://127.0.0.1:{relay.port}", timeout_s=1)
    direct = EtcdClient(etcd_server.url)
    key = f"/t-{uuid.uuid4().hex[:8]}/held"
    lease = client.grant(5)
    try:
        client.put(key, 1, lease)
        assert lease.refresh()
        relay.cut()
        with pytest.raises(StoreUnavailable, match=r"lease \w+ refresh"):
            lease.refresh()
        relay.restore()
        assert lease.refresh()
        assert lease.streams_opened == 2
        relay.stall()  # a stalled etcd: the refresh gives up after the client's timeout
        with pytest.raises(StoreUnavailable, match=r"lease \w+ refresh"):
            lease.refresh()
        relay.resume()
        assert lease.refresh()
        assert lease.streams_opened == 3
        assert direct.get(key) is not None, "the lease survived the disruptions"
    finally:
        relay.resume()
        lease.revoke()
        client.close()
        direct.close()


def test_training_goes_on_through_an_etcd_disconnect_stall_and_compaction(
    etcd_server: ManagedServer, relay: Relay
) -> None:
    """Two in-process workers whose cluster state is in etcd behind the relay: mid-step
    the relay is cut (a change made meanwhile must still reach both watchers), restored,
    then stalled and resumed, then cut again while etcd compacts past the revision both
    watches hold (each must re-read the prefix once and see the change made meanwhile);
    training goes on in generation 0 and ends with the reference's parameters."""
    job_id = f"disrupt-{uuid.uuid4().hex[:8]}"
    job = toy_job(steps=8, microbatches=4, redundancy=RedundancyMode.EAGER_FRC_LAZY_BRC)
    direct = EtcdClient(etcd_server.url)
    meanwhile = etcd_keys.runtime_prefix(job_id) + "done/77/5"  # no worker's business
    compacted = etcd_keys.runtime_prefix(job_id) + "done/78/5"  # made before a compaction
    disrupted = threading.Event()
    workers: list[Worker] = []
    errors: list[BaseException] = []  # the workers' and the disruption's

    def disrupt() -> None:
        try:
            relay.cut()
            direct.put(meanwhile, {"step": 0})  # made while both watches are cut off
            time.sleep(0.5)  # shorter than the lease TTL: nobody may be declared dead
            relay.restore()
            wait_for(
                lambda: all(77 in w._view.snapshot().done for w in workers),
                "the change made during the cut reached every watcher",
            )
            relay.stall()
            time.sleep(0.5)
            relay.resume()
            fulls_before = list(fulls)
            relay.cut()
            for i in range(3):  # history the compaction removes, past the watches' revision
                direct.put(compacted, {"step": i})
            direct.raw.compact(direct.revision())
            time.sleep(0.3)
            relay.restore()
            wait_for(
                lambda: all(78 in w._view.snapshot().done for w in workers),
                "the change made before the compaction reached every watcher",
            )
            assert [f - b for f, b in zip(fulls, fulls_before, strict=True)] == [1, 1], (
                f"full re-reads per watcher after the compaction: {fulls} (was {fulls_before})"
            )
        except BaseException as exc:
            errors.append(exc)
        finally:
            disrupted.set()

    started = threading.Lock()

    def batch(step: int, pipeline: int, microbatch: int) -> Batch:
        if step == 3 and microbatch == 1 and not disrupted.is_set():
            # mid-step: the disruption happens while the pipeline is in flight
            if started.acquire(blocking=False):
                threading.Thread(target=disrupt, daemon=True).start()
            disrupted.wait(30)
        return toy_batch(step, pipeline, microbatch)

    job.batch = batch
    store = dist.HashStore()
    stores = [EtcdClusterStateStore(f"http://127.0.0.1:{relay.port}", job_id) for _ in range(2)]
    results: list[dict[str, torch.Tensor]] = [{}, {}]
    fulls = [0, 0]  # full re-reads each worker's view received
    for w in range(2):
        # TTL 3 s: the cuts and the stall must not cost a lease. With gRPC's default
        # reconnect backoff a 3 s lease lapsed in 3 of 12 runs (both workers declared each
        # other dead); contract/etcd.py's channel options fixed it (issue #24, session 12)
        opts = WorkerOptions(worker=w, stages=2, pipelines=1, lease_ttl_s=3, verbose=False)
        worker = Worker(job, opts, stores[w], store)
        view_apply = worker._view.apply

        def counting(
            changes: list[Change], full: bool, w: int = w, apply: Any = view_apply
        ) -> None:
            fulls[w] += full
            apply(changes, full)

        worker._view.apply = counting  # type: ignore[method-assign]
        workers.append(worker)

    def run(w: int) -> None:
        try:
            results[w] = workers[w].run()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,), name=f"worker{w}") for w in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "training hung after the disruption"
        assert not errors, errors
        assert disrupted.is_set(), "the disruption never ran: it happened after training"
        assert [w.generation for w in workers] == [0, 0], "a worker was declared dead"
        ref = reference_train(toy_job(steps=8, microbatches=4), pipelines=1)
        for params in results:
            for key, value in params.items():
                torch.testing.assert_close(value, ref[key], rtol=1e-9, atol=1e-11, msg=key)
    finally:
        relay.resume()
        for s in stores:
            s.delete_all()
            s.close()
        direct.close()
