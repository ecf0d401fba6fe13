from __future__ import annotations

from typing import cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.api import (
    InvalidJobRequest,
    JobRequest,
    JobTooLarge,
    SchedState,
    UnknownGpuType,
    UnknownJob,
)
from services.scheduler.cluster import Cluster
from services.scheduler.persist import MemoryPlacementStore
from services.scheduler.scheduler import GangScheduler
from tests.services.scheduler.conftest import gpu_cluster


def _job(job_id: str, learners: int, gpus: int = 1, **kw: object) -> JobRequest:
    return JobRequest(job_id, learners=learners, gpus=gpus, gpu_type="V100", **kw)  # type: ignore[arg-type]


def _assert_invariants(sched: GangScheduler) -> None:
    cluster = sched.cluster
    used = np.zeros(len(cluster.nodes), dtype=np.int64)
    for job_id, rec in sched.records.items():
        alloc = cluster.allocations.get(job_id)
        if rec.state == SchedState.QUEUED:
            assert alloc is None, f"queued job {job_id} holds resources"
            assert job_id in sched.queue
        else:
            assert alloc is not None and len(alloc.learner_nodes) == rec.job.learners, (
                "partial gang"
            )
            assert (
                rec.placement is not None and len(rec.placement.learner_nodes) == rec.job.learners
            )
            for idx in alloc.learner_nodes:
                used[idx] += rec.job.gpus
    assert set(cluster.allocations) <= set(sched.records)
    assert np.all(used <= cluster.gpus_total), "GPU over-commitment"
    assert np.array_equal(cluster.gpus_total - used, cluster.gpus_free)


job_specs = st.tuples(st.integers(1, 6), st.sampled_from([1, 2, 4]), st.integers(0, 2))
ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), job_specs),
        st.tuples(st.just("schedule"), st.none()),
        st.tuples(st.just("release"), st.integers(0, 30)),
    ),
    max_size=40,
)


def _run(
    ops_list: list[tuple[str, object]], seed: int, policy: str
) -> tuple[GangScheduler, list[object]]:
    sched = GangScheduler(
        gpu_cluster(nodes=5, gpus=4, zones=2), policy=policy, seed=seed, clock=lambda: 0.0
    )
    trace: list[object] = []
    n = 0
    for op, arg in ops_list:
        if op == "submit":
            learners, gpus, prio = cast(tuple[int, int, int], arg)
            trace.append(
                sched.submit(_job(f"j{n}", learners, gpus, priority=prio, arrival=float(n)))
            )
            n += 1
        elif op == "schedule":
            trace.append(sched.schedule())
        else:
            trace.append(sched.release(f"j{arg}"))
        _assert_invariants(sched)
    return sched, trace


@settings(max_examples=60, deadline=None)
@given(ops_list=ops, seed=st.integers(0, 1000), policy=st.sampled_from(["pack", "spread"]))
def test_gang_invariant_and_no_overcommit_hold_after_every_operation(
    ops_list: list[tuple[str, object]], seed: int, policy: str
) -> None:
    _run(ops_list, seed, policy)


@settings(max_examples=25, deadline=None)
@given(ops_list=ops, seed=st.integers(0, 1000))
def test_same_seed_and_calls_give_the_same_decisions(
    ops_list: list[tuple[str, object]], seed: int
) -> None:
    _, first = _run(ops_list, seed, "pack")
    _, second = _run(ops_list, seed, "pack")
    assert first == second


def test_jobs_submitted_together_go_largest_gang_first() -> None:
    sched = GangScheduler(gpu_cluster(nodes=2, gpus=4), clock=lambda: 0.0)
    sched.submit(_job("small", 2, arrival=0.0))
    sched.submit(_job("large", 2, 4, arrival=0.2))
    placed = [p.job_id for p in sched.schedule().placements]
    assert placed == ["large"]
    assert sched.queued() == ["small"]


def test_fcfs_across_batches_blocks_later_jobs_of_the_same_gpu_type_only() -> None:
    cluster = Cluster(
        gpu_cluster(nodes=2, gpus=4).nodes + gpu_cluster(nodes=1, gpus=4, gpu_type="K80").nodes[:0]
    )
    sched = GangScheduler(cluster, clock=lambda: 0.0)
    sched.submit(_job("first", 2, 3, arrival=0.0))
    sched.schedule()
    sched.submit(_job("head", 2, 3, arrival=10.0))  # cannot fit until first ends
    sched.submit(_job("later", 1, 1, arrival=20.0))  # would fit, but FCFS holds it
    assert sched.schedule().placements == []
    assert "must start first (first: head)" in sched.explain("later")
    back = GangScheduler(gpu_cluster(nodes=2, gpus=4), backfill=True, clock=lambda: 0.0)
    back.submit(_job("first", 2, 3, arrival=0.0))
    back.submit(_job("head", 2, 3, arrival=10.0))
    back.submit(_job("later", 1, 1, arrival=20.0))
    assert [p.job_id for p in back.schedule().placements] == ["first", "later"]


def test_a_blocked_pool_does_not_hold_back_another_gpu_type() -> None:
    from services.scheduler.cluster import Node

    cluster = Cluster(
        [
            Node("v0", 8, 1000, gpus=4, gpu_type="V100"),
            Node("v1", 8, 1000, gpus=4, gpu_type="V100"),
            Node("k", 8, 1000, gpus=4, gpu_type="K80"),
        ]
    )
    sched = GangScheduler(cluster, clock=lambda: 0.0)
    sched.submit(_job("v-fill", 1, 4, arrival=0.0))
    sched.schedule()
    sched.submit(_job("v-big", 2, 4, arrival=5.0))
    sched.submit(_job("v-small", 1, 1, arrival=6.0))
    assert sched.schedule().placements == []  # v-big waits for v-fill, v-small behind it
    assert sched.state("v-big") == SchedState.QUEUED
    sched.submit(JobRequest("k80", learners=1, gpus=2, gpu_type="K80", arrival=9.0))
    assert [p.job_id for p in sched.schedule().placements] == ["k80"]


def test_admission_refuses_what_can_never_fit_with_the_reason() -> None:
    sched = GangScheduler(gpu_cluster(nodes=2, gpus=4))
    big = sched.admit(_job("big", 3, 4))
    assert not big.admitted and big.error == "JobTooLarge"
    assert "room for only 2" in big.reason
    assert sched.admit(_job("span", 2, 3, max_nodes=1)).error == "JobTooLarge"
    with pytest.raises(JobTooLarge):
        sched.enqueue(_job("big", 3, 4))
    assert sched.queued() == []


def test_admission_answers_each_job_of_a_shape_alike_and_follows_a_new_cluster_model() -> None:
    # The room a shape has on the empty cluster is worked out once per cluster model
    # (`_room_when_empty`): each refusal still names its own job, a max_nodes bound is a
    # shape of its own, and nodes added to the model change the answer.
    sched = GangScheduler(gpu_cluster(nodes=2, gpus=4))
    assert "job big-1 can never run" in sched.admit(_job("big-1", 3, 4)).reason
    assert "job big-2 can never run" in sched.admit(_job("big-2", 3, 4)).reason
    assert sched.admit(_job("fits", 2, 3)).admitted
    assert "the 1 largest nodes hold only 1" in sched.admit(_job("span", 2, 3, max_nodes=1)).reason
    sched.replace_nodes(gpu_cluster(nodes=3, gpus=4).nodes)
    assert sched.admit(_job("big-3", 3, 4)).admitted


@pytest.mark.parametrize(
    ("job", "error", "message"),
    [
        (JobRequest("z", learners=0), InvalidJobRequest, "at least 1 learner"),
        (
            JobRequest("t", learners=1, gpus=1, gpu_type="A100"),
            UnknownGpuType,
            "unknown GPU type 'A100'",
        ),
        (JobRequest("n", learners=1, gpus=1), InvalidJobRequest, "no gpu_type"),
        (JobRequest("c", learners=1, cpus=-1.0), InvalidJobRequest, "cpus=-1.0"),
        (JobRequest("", learners=1), InvalidJobRequest, "job_id is empty"),
    ],
)
def test_bad_requests_get_clear_errors(
    job: JobRequest, error: type[Exception], message: str
) -> None:
    sched = GangScheduler(gpu_cluster())
    with pytest.raises(error, match=message):
        sched.check(job)
    result = sched.admit(job)
    assert not result.admitted and message in result.reason


def test_resubmitting_the_same_job_is_idempotent_but_a_changed_one_is_refused() -> None:
    sched = GangScheduler(gpu_cluster())
    sched.submit(_job("j", 2, arrival=1.0))
    sched.submit(_job("j", 2, arrival=2.0))
    assert sched.queued() == ["j"]
    with pytest.raises(InvalidJobRequest, match="different request"):
        sched.enqueue(_job("j", 3))


def test_explain_a_queued_job_names_the_largest_free_block() -> None:
    sched = GangScheduler(gpu_cluster(nodes=3, gpus=4), clock=lambda: 0.0)
    sched.submit(_job("a", 1, 4, arrival=0))
    sched.submit(_job("b", 1, 1, arrival=0))
    sched.schedule()
    sched.submit(_job("w", 2, 4, max_nodes=2, arrival=9))
    sched.schedule()
    text = sched.explain("w")
    assert text.startswith("job w is queued: needs 2 learners × 4 V100 on ≤ 2 nodes")
    assert "the largest free block is 4 V100 on n2" in text
    assert "room for 1 of its 2 learners now" in text
    assert "n0" in sched.explain("a") and "reserved" in sched.explain("a")
    with pytest.raises(UnknownJob):
        sched.explain("nope")


def test_release_frees_the_gang_and_the_next_job_starts() -> None:
    sched = GangScheduler(gpu_cluster(nodes=1, gpus=4), clock=lambda: 0.0)
    sched.submit(_job("a", 2, 2, arrival=0))
    sched.submit(_job("b", 1, 4, arrival=5))
    sched.schedule()
    assert sched.state("b") == SchedState.QUEUED
    assert sched.release("a") and not sched.release("a")
    assert [p.job_id for p in sched.schedule().placements] == ["b"]
    sched.confirm("b")
    assert sched.state("b") == SchedState.BOUND
    assert "running on n0" in sched.explain("b")


def test_restart_from_the_store_keeps_reservations_and_never_double_books() -> None:
    store = MemoryPlacementStore()
    first = GangScheduler(gpu_cluster(nodes=2, gpus=4), store=store, clock=lambda: 0.0)
    for i in range(3):
        first.submit(_job(f"j{i}", 2, 2, arrival=float(i)))
    placed = {p.job_id: p.learner_nodes for p in first.schedule().placements}
    assert set(placed) == {"j0", "j1"}
    second = GangScheduler(gpu_cluster(nodes=2, gpus=4), store=store, clock=lambda: 0.0)
    assert {j: second.placement(j).learner_nodes for j in placed} == placed  # type: ignore[union-attr]
    assert second.queued() == ["j2"]
    assert second.schedule().placements == []  # nothing is free: no double booking
    assert sorted(second.restored_reservations) == ["j0", "j1"]
    _assert_invariants(second)


def test_a_reservation_that_no_longer_fits_after_restart_is_requeued() -> None:
    store = MemoryPlacementStore()
    first = GangScheduler(gpu_cluster(nodes=2, gpus=4), store=store, clock=lambda: 0.0)
    first.submit(_job("j", 2, 4))
    first.schedule()
    shrunk = GangScheduler(gpu_cluster(nodes=1, gpus=4), store=store)
    assert shrunk.state("j") == SchedState.QUEUED
    _assert_invariants(shrunk)
