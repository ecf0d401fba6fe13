"""The live queue in Tiresias order when the cluster config selects Elastic-Tiresias
(issue #19): the user's priority first, then the Tiresias queue of the GPU·s a job
attained in its earlier placements, then arrival. The default policy keeps the FCFS
order. Unit tests on the GangScheduler, with a fake clock; then the daemon's scheduling
loop (real MongoDB-wire server) placing by that order."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rhizome.v1 import job_pb2

from services.client.sdk import Client
from services.daemon import Daemon
from services.embedded.process import ManagedServer
from services.scheduler.api import JobRequest
from services.scheduler.elasticity import get_scaling_policy, scaling_from_config
from services.scheduler.elasticity.tiresias import tiresias_queue
from services.scheduler.persist import MemoryPlacementStore
from services.scheduler.queue import JobQueue, QueueOrder
from services.scheduler.quota import QuotaConfig, quota_config_from_mapping
from services.scheduler.scheduler import GangScheduler
from tests.daemons import own_database, start_daemon
from tests.integration.conftest import token_client, wait_job_status
from tests.services.scheduler.conftest import gpu_cluster

# quanta of 100 and 1,000 GPU·s: three queues, crossed within a test's fake seconds
QUANTA = [100.0, 1000.0]
# alice owns the 4 GPUs; bob has no quota and borrows
QUOTAS = {"users": {"alice": {"quota": {"V100": 4}}, "bob": {"quota": {}}}}


def job(job_id: str, learners: int, arrival: float, *, owner: str = "",
        priority: int = 0) -> JobRequest:  # fmt: skip
    return JobRequest(job_id, learners=learners, gpus=1, gpu_type="V100", owner=owner,
                      priority=priority, arrival=arrival)  # fmt: skip


def tiresias(
    now: list[float], store: MemoryPlacementStore | None = None, quotas: QuotaConfig | None = None
) -> GangScheduler:
    policy = get_scaling_policy("elastic-tiresias", quanta_gpu_s=QUANTA)
    return GangScheduler(
        gpu_cluster(nodes=1, gpus=4), clock=lambda: now[0], scaling=policy, store=store,
        quotas=quotas,
    )  # fmt: skip


def test_a_job_past_the_first_quantum_waits_behind_a_newer_short_one() -> None:
    now = [0.0]
    sched = tiresias(now)
    sched.submit(job("long", 4, arrival=0))
    assert [p.job_id for p in sched.schedule(now=0).placements] == ["long"]
    # 4 GPUs × 50 s = 200 GPU·s: past the first quantum (100), queue 1
    now[0] = 50.0
    sched.release("long")
    assert sched.attained("long") == 200.0
    sched.submit(job("long", 4, arrival=0))  # it comes back (a resume), same arrival
    sched.submit(job("short", 4, arrival=40))  # newer, attained nothing: queue 0
    assert sched.queued() == ["short", "long"]
    assert sched.queue.ahead_of("long") == 1
    reason = sched.explain("long")
    assert "queue 1 of 3 (attained 200 GPU·s" in reason, reason
    assert "queue 0 of 3 (attained 0 GPU·s" in sched.explain("short")
    assert [p.job_id for p in sched.schedule(now=50).placements] == ["short"]


def test_the_users_priority_still_goes_first() -> None:
    now = [0.0]
    sched = tiresias(now)
    sched.submit(job("urgent", 4, arrival=0, priority=5))
    sched.schedule(now=0)
    now[0] = 1000.0  # 4,000 GPU·s: the deepest queue
    sched.release("urgent")
    sched.submit(job("urgent", 4, arrival=0, priority=5))
    sched.submit(job("short", 4, arrival=900))
    assert sched.queued() == ["urgent", "short"]


def test_the_default_policy_keeps_the_fcfs_order() -> None:
    now = [0.0]
    for sched in (
        GangScheduler(gpu_cluster(nodes=1, gpus=4), clock=lambda: now[0]),
        GangScheduler(
            gpu_cluster(nodes=1, gpus=4),
            clock=lambda: now[0],
            scaling=scaling_from_config({"scheduler": {"scaling": "none"}}),
        ),
    ):
        now[0] = 0.0
        sched.submit(job("long", 4, arrival=0))
        sched.schedule(now=0)
        now[0] = 50.0
        sched.release("long")
        sched.submit(job("long", 4, arrival=0))
        sched.submit(job("short", 4, arrival=40))
        # FCFS: the earlier arrival first, whatever it attained; no Tiresias words
        assert sched.queued() == ["long", "short"]
        assert sched.queue.order is None
        assert "Tiresias" not in sched.explain("long")


def test_attained_service_survives_a_restore_from_the_store() -> None:
    now = [0.0]
    store = MemoryPlacementStore()
    quotas = quota_config_from_mapping(QUOTAS, ["V100"])
    sched = tiresias(now, store=store, quotas=quotas)
    sched.submit(job("bob", 4, arrival=0, owner="bob"))
    sched.schedule(now=0)
    sched.submit(job("alice", 4, arrival=30, owner="alice"))
    assert sched.schedule(now=30).preempted == ["bob"]  # 4 × 30 = 120 GPU·s, queue 1
    sched.submit(job("new", 4, arrival=35, owner="bob"))
    assert sched.queued() == ["new", "bob"]
    assert store.docs["bob"]["attained_gpu_s"] == 120.0

    restored = tiresias(now, store=store, quotas=quotas)
    assert restored.records["bob"].attained_gpu_s == 120.0
    assert restored.queued() == ["new", "bob"]
    assert "attained 120 GPU·s" in restored.explain("bob")
    now[0] = 40.0
    assert restored.attained("alice") == 4 * 10.0  # placed at 30, still running


def test_a_requeue_after_a_preemption_re_keys_the_job() -> None:
    now = [0.0]
    quotas = quota_config_from_mapping(QUOTAS, ["V100"])
    sched = tiresias(now, quotas=quotas)
    sched.submit(job("bob", 4, arrival=0, owner="bob"))
    sched.schedule(now=0)
    sched.submit(job("alice", 4, arrival=30, owner="alice"))
    assert sched.schedule(now=30).preempted == ["bob"]
    entry = sched.queue.get("bob")
    assert entry is not None and entry.attained_gpu_s == 120.0
    assert entry.key[1] == 1  # re-keyed with what it attained: queue 1
    sched.submit(job("later", 4, arrival=35, owner="bob"))
    assert sched.queued() == ["later", "bob"]
    # alice ends; the newer short job starts first
    now[0] = 40.0
    sched.release("alice")
    assert [p.job_id for p in sched.schedule(now=40).placements] == ["later"]

    # FCFS would have put it first again (its seq and arrival are older)
    fcfs = GangScheduler(gpu_cluster(nodes=1, gpus=4), quotas=quotas, clock=lambda: now[0])
    fcfs.submit(job("bob", 4, arrival=0, owner="bob"))
    fcfs.schedule(now=0)
    fcfs.submit(job("alice", 4, arrival=30, owner="alice"))
    assert fcfs.schedule(now=30).preempted == ["bob"]
    fcfs.submit(job("later", 4, arrival=35, owner="bob"))
    assert fcfs.queued() == ["bob", "later"]


def test_an_elastic_jobs_scale_gangs_and_shrinks_add_to_its_attained_service() -> None:
    now = [0.0]
    sched = tiresias(now)
    sched.submit(job("el", 2, arrival=0))
    sched.schedule(now=0)
    sched.set_elastic("el", 1, 4)
    gang = sched.place_now(job("el+scale-1", 2, arrival=0))
    assert gang.placed_at == 0.0
    now[0] = 10.0
    assert sched.attained("el") == 40.0  # 4 learners × 10 s
    # the driver's queues use the same number
    (ej,) = sched.elasticity.elastic_jobs(sched.records["el"].job.pool, 10.0)
    assert ej.attained_gpu_s == 40.0
    sched.release("el+scale-1")  # the scale-in retired the gang: its service stays the job's
    now[0] = 20.0
    assert sched.attained("el") == 40.0 + 2 * 10.0
    sched.resize("el", 1)  # down to one learner at 20 s
    now[0] = 30.0
    assert sched.attained("el") == 60.0 + 1 * 10.0


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["push", "remove"]),
            st.integers(0, 11),  # job number
            st.integers(0, 2),  # priority
            st.sampled_from([0.0, 50.0, 150.0, 5000.0]),  # attained GPU·s
            st.sampled_from(["", "V100", "K80"]),
            st.floats(0, 10),  # arrival
        ),
        max_size=50,
    )
)
def test_the_tiresias_ordered_queue_equals_a_full_sort_after_any_pushes_and_removes(
    steps: list[tuple[str, int, int, float, str, float]],
) -> None:
    policy = get_scaling_policy("elastic-tiresias", quanta_gpu_s=QUANTA)
    assert isinstance(policy, QueueOrder)
    queue = JobQueue(order=policy)
    for op, n, priority, attained, gpu_type, arrival in steps:
        job_id = f"job-{n}"
        if op == "push":
            gpus = 1 if gpu_type else 0
            request = JobRequest(job_id, learners=1, gpus=gpus, gpu_type=gpu_type,
                                 priority=priority, arrival=arrival)  # fmt: skip
            queue.push(request, attained_gpu_s=attained)
        else:
            queue.remove(job_id)
        entries = [e for e in (queue.get(f"job-{i}") for i in range(12)) if e is not None]
        expected = sorted(entries, key=policy.queue_key)
        assert queue.ordered() == expected
        for entry in expected:
            same_pool = [e for e in expected if e.job.pool == entry.job.pool]
            assert queue.ahead_of(entry.job.job_id) == same_pool.index(entry)
        # priority, then Tiresias queue, then arrival
        keys = [(-e.job.priority, tiresias_queue(e.attained_gpu_s, QUANTA), e.job.arrival)
                for e in expected]  # fmt: skip
        assert keys == sorted(keys)


# -- live: the daemon's scheduling loop -----------------------------------------------------

CLUSTER = """nodes:
  - name: gpu-node
    cpus: 8
    memory_mb: 8192
    gpus: 4
    gpu_type: FAKE
scheduler:
  scaling: {scaling}
  scaling_options: {options}
"""
GPU_JOB = (
    "name: {name}\nlearners: 2\ngpus: 2\ngpu_type: FAKE\ncpus: 1\nmemory: 512\n"
    "framework: {{command: 'true'}}\n"
)


def live_daemon(mongo: ManagedServer, data_dir: Path, scaling: str, options: str) -> Daemon:
    (data_dir / "cluster.yaml").write_text(CLUSTER.format(scaling=scaling, options=options))
    return start_daemon(
        data_dir,
        mongo,
        # a database of its own: other tests' queued jobs must not compete for its GPUs
        database=own_database(data_dir),
        services=("api", "scheduler"),  # no LCM: placed jobs stay PENDING
        cluster_config=str(data_dir / "cluster.yaml"),
    )


def reason_has(client: Client, job_id: str, text: str, timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    reason = ""
    while time.monotonic() < deadline:
        reason = client.get_job(job_id).queue_reason
        if text in reason:
            return reason
        time.sleep(0.1)
    raise AssertionError(f"{job_id}'s queue reason lacks {text!r}: {reason!r}")


@pytest.mark.integration
@pytest.mark.parametrize(
    ("scaling", "options", "first"),
    [("elastic-tiresias", "{quanta_gpu_s: [1.0]}", "short"), ("none", "{}", "long")],
)
def test_the_daemon_places_a_new_short_job_before_a_resumed_long_one_under_tiresias(
    mongo_server: ManagedServer, tmp_path: Path, scaling: str, options: str, first: str
) -> None:
    daemon = live_daemon(mongo_server, tmp_path, scaling, options)
    try:
        with token_client(daemon, "user") as rz:
            long = rz.create_job(GPU_JOB.format(name="long")).job_id
            wait_job_status(
                rz, long, job_pb2.PENDING, timeout_s=30
            )  # holds the 4 GPUs: 4 GPU·s a second
            time.sleep(1.0)  # past the 1 GPU·s quantum
            rz.halt_job(long)  # the scheduler releases it, adding up its service
            holder = rz.create_job(GPU_JOB.format(name="holder")).job_id
            wait_job_status(rz, holder, job_pb2.PENDING, timeout_s=30)
            # both wait for the holder's GPUs: the long job came back first (and was
            # created first), the short one is new
            assert rz.resume_job(long).status == job_pb2.QUEUED
            reason_has(rz, long, "needs 2 learners")
            short = rz.create_job(GPU_JOB.format(name="short")).job_id
            if scaling == "elastic-tiresias":
                reason_has(rz, long, "Elastic-Tiresias order: queue 1 of 2 (attained ")
                assert "queue 0 of 2 (attained 0 GPU·s" in reason_has(rz, short, "queue 0")
            else:
                reason_has(rz, short, "needs 2 learners")
                assert "Tiresias" not in rz.get_job(long).queue_reason
            rz.delete_job(holder)
            other = short if first == "long" else long
            wait_job_status(rz, short if first == "short" else long, job_pb2.PENDING, timeout_s=30)
            time.sleep(1.0)  # several passes: the other one still waits
            assert rz.get_job(other).status == job_pb2.QUEUED
            for job_id in (long, short):
                rz.delete_job(job_id)
    finally:
        daemon.stop()


@pytest.mark.integration
def test_a_halted_jobs_attained_service_survives_a_daemon_restart(
    mongo_server: ManagedServer, tmp_path: Path
) -> None:
    """The scheduler remembers a released job's service in memory; the daemon also
    writes it to the job's record, so that a job resumed after a restart goes back to the
    Tiresias queue its service earned, not to queue 0 as a new job would."""
    options = "{quanta_gpu_s: [1.0]}"
    daemon = live_daemon(mongo_server, tmp_path, "elastic-tiresias", options)
    try:
        with token_client(daemon, "user") as rz:
            long = rz.create_job(GPU_JOB.format(name="long")).job_id
            wait_job_status(rz, long, job_pb2.PENDING, timeout_s=30)
            time.sleep(1.0)  # 4 GPUs held: past the 1 GPU·s quantum
            rz.halt_job(long)
            wait_job_status(rz, long, job_pb2.HALTED, timeout_s=30)
            holder = rz.create_job(GPU_JOB.format(name="holder")).job_id
            wait_job_status(rz, holder, job_pb2.PENDING, timeout_s=30)
            deadline = time.monotonic() + 30
            while daemon.ctx.shared["jobs"].get(long).attained_gpu_s <= 0:
                assert time.monotonic() < deadline, "the attained service was never written"
                time.sleep(0.1)
    finally:
        daemon.stop()
    daemon = live_daemon(mongo_server, tmp_path, "elastic-tiresias", options)
    try:
        with token_client(daemon, "user") as rz:
            assert rz.resume_job(long).status == job_pb2.QUEUED
            reason = reason_has(rz, long, "Elastic-Tiresias order: queue 1 of 2 (attained ")
            assert "attained 0 GPU·s" not in reason, reason
            for job_id in (long, holder):
                rz.delete_job(job_id)
    finally:
        daemon.stop()
