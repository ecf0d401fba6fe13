"""Elastic-Tiresias (Amoeba §6) as a scaling policy: its decisions alone, and through the
GangScheduler on a small cluster model (unit tests: no servers)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from services.scheduler.api import JobRequest
from services.scheduler.cluster import ClusterConfigError, nodes_from_config
from services.scheduler.elasticity import (
    ScalingConfigError,
    get_scaling_policy,
    load_scaling_config,
    scaling_from_config,
)
from services.scheduler.elasticity.api import CommunicationBound, ElasticJob, StaticScaling
from services.scheduler.elasticity.tiresias import ElasticTiresias, tiresias_queue
from services.scheduler.scheduler import GangScheduler
from tests.services.scheduler.conftest import gpu_cluster

QUANTA = (10_000.0, 200_000.0)


def ejob(job_id: str, learners: int, attained: float, *, lo: int = 1, hi: int = 8,
         arrival: float = 0.0) -> ElasticJob:  # fmt: skip
    return ElasticJob(job_id, learners, lo, hi, 1, attained, arrival, "V100")


def test_tiresias_queues_follow_the_attained_service_thresholds() -> None:
    assert [tiresias_queue(s, QUANTA) for s in (0, 9_999, 10_000, 199_999, 200_000, 1e9)] == [
        0, 0, 1, 1, 2, 2,
    ]  # fmt: skip


def test_nothing_shrinks_while_no_more_than_the_threshold_of_jobs_wait() -> None:
    policy = ElasticTiresias(pending_threshold=2)
    jobs = [ejob("a", 4, 50_000)]
    assert policy.shrink(2, 2, jobs, lambda sizes: True) == []
    assert [d.learners for d in policy.shrink(2, 3, jobs, lambda sizes: True)] == [2]


def test_jobs_in_the_first_queue_are_never_shrunk() -> None:
    policy = ElasticTiresias()
    assert policy.shrink(1, 1, [ejob("short", 4, 9_000)], lambda sizes: True) == []


def test_the_lowest_priority_job_halves_first_and_only_as_many_as_needed() -> None:
    policy = ElasticTiresias()
    jobs = [
        ejob("q1-early", 4, 50_000, arrival=1),
        ejob("q2", 4, 300_000, arrival=5),
        ejob("q1-late", 4, 60_000, arrival=9),
    ]
    # the waiting job needs 2 learners: halving one 4-learner job is enough
    freed = {"q1-early": 2, "q2": 2, "q1-late": 2}
    decisions = policy.shrink(2, 1, jobs, lambda s: sum(freed[j] for j in s) >= 2)
    assert [(d.job_id, d.learners) for d in decisions] == [("q2", 2)]
    assert "queue 2" in decisions[0].reason
    # 4 learners: the deepest queue, then the latest arrival of queue 1
    decisions = policy.shrink(4, 1, jobs, lambda s: sum(freed[j] for j in s) >= 4)
    assert [(d.job_id, d.learners) for d in decisions] == [("q2", 2), ("q1-late", 2)]


def test_when_halving_is_not_enough_jobs_go_on_to_their_minimum() -> None:
    policy = ElasticTiresias()
    jobs = [ejob("a", 8, 50_000, lo=1)]
    decisions = policy.shrink(7, 1, jobs, lambda s: 8 - s.get("a", 8) >= 7)
    assert [(d.job_id, d.learners) for d in decisions] == [("a", 1)]


def test_nobody_shrinks_for_nothing_when_the_waiting_job_still_would_not_fit() -> None:
    policy = ElasticTiresias()
    jobs = [ejob("a", 4, 50_000, lo=2)]
    assert policy.shrink(16, 1, jobs, lambda sizes: False) == []


def test_idle_capacity_goes_to_the_largest_marginal_gain_up_to_max() -> None:
    policy = ElasticTiresias(throughput_overhead=0.1)
    jobs = [ejob("big", 6, 50_000, hi=8), ejob("small", 1, 50_000, hi=3)]
    budget = [4]

    def take(job_id: str) -> bool:
        if budget[0] == 0:
            return False
        budget[0] -= 1
        return True

    decisions = {d.job_id: d.learners for d in policy.grow(jobs, take)}
    # sub-linear scaling: the small job gains more per learner until it reaches its max
    assert decisions == {"small": 3, "big": 8}


def test_the_throughput_model_is_sub_linear_and_one_at_one_learner() -> None:
    model = CommunicationBound(0.1)
    assert model.throughput(1) == 1.0
    assert model.gain(1) > model.gain(4) > 0
    with pytest.raises(ScalingConfigError, match=r"overhead=1.5; use a number in \[0, 1\)"):
        CommunicationBound(1.5)


def test_the_policy_is_chosen_in_the_cluster_config(tmp_path: Path) -> None:
    config = {
        "nodes": [{"name": "n", "cpus": 2, "memory_mb": 1024}],
        "scheduler": {"scaling": "elastic-tiresias", "scaling_options": {"pending_threshold": 3}},
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    policy = load_scaling_config(path)
    assert isinstance(policy, ElasticTiresias) and policy.pending_threshold == 3
    assert [n.name for n in nodes_from_config(config)] == ["n"]  # the nodes still read
    assert isinstance(scaling_from_config({"nodes": []}), StaticScaling)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"scaling": "elastic-tiresia"}, "unknown scaling policy 'elastic-tiresia'; choose one"),
        ({"scalin": "none"}, "unknown key 'scalin' (did you mean 'scaling'?)"),
        ({"scaling": "elastic-tiresias", "scaling_options": {"quanta": [1]}},
         "unknown option 'quanta'"),
        ({"scaling": "elastic-tiresias", "scaling_options": {"quanta_gpu_s": [5, 1]}},
         "must increase strictly"),
        ({"scaling": "elastic-tiresias", "scaling_options": {"pending_threshold": -1}},
         "pending_threshold=-1; use a whole number >= 0"),
    ],
)  # fmt: skip
def test_a_bad_scheduler_section_is_refused_naming_the_key(
    section: dict[str, object], message: str
) -> None:
    with pytest.raises(ScalingConfigError, match=re.escape(message)):
        scaling_from_config({"nodes": [], "scheduler": section}, "c.yaml")


def test_an_unknown_top_level_key_still_names_the_known_ones() -> None:
    with pytest.raises(ClusterConfigError, match="unknown top-level key 'schedulr'"):
        nodes_from_config({"nodes": [{"name": "n", "cpus": 1, "memory_mb": 1}], "schedulr": {}})


# -- through the GangScheduler ----------------------------------------------------------


def gang(job_id: str, learners: int, arrival: float = 0.0) -> JobRequest:
    return JobRequest(job_id, learners=learners, gpus=1, gpu_type="V100", arrival=arrival)


def running_elastic(sched: GangScheduler, job_id: str, learners: int, lo: int, hi: int) -> None:
    sched.submit(gang(job_id, learners))
    assert [p.job_id for p in sched.schedule(now=0).placements] == [job_id]
    sched.set_elastic(job_id, lo, hi)


def test_a_queued_gang_waits_for_a_shrink_and_is_placed_once_it_is_done() -> None:
    sched = GangScheduler(
        gpu_cluster(nodes=2, gpus=4), scaling=get_scaling_policy("elastic-tiresias")
    )
    running_elastic(sched, "elastic", 8, 2, 8)
    sched.submit(gang("waiting", 4, arrival=100_000))
    # 8 GPUs for 100,000 s: 800,000 GPU·s attained, queue 2 -> halved to 4
    result = sched.schedule(now=100_000)
    assert result.placements == [] and result.preempted == []
    assert result.resize["elastic"][0] == 4
    assert "waiting for elastic job elastic to shrink" in sched.explain("waiting")
    # asked once: the next pass waits for the same shrink
    assert sched.schedule(now=100_001).resize == {}
    # the guardian applied it: the job runs on 4; its resources are freed, the gang goes in
    assert sched.resize("elastic", 4)
    placed = sched.schedule(now=100_002).placements
    assert [p.job_id for p in placed] == ["waiting"]
    assert sched.job_size("elastic") == 4 and sched.cluster.free_gpus() == 0


def test_the_static_policy_never_resizes() -> None:
    sched = GangScheduler(gpu_cluster(nodes=2, gpus=4))
    running_elastic(sched, "elastic", 8, 2, 8)
    sched.submit(gang("waiting", 4))
    result = sched.schedule(now=1e6)
    assert result.resize == {} and result.placements == []


def test_idle_capacity_grows_elastic_jobs_only_while_nobody_waits() -> None:
    sched = GangScheduler(
        gpu_cluster(nodes=2, gpus=4), scaling=get_scaling_policy("elastic-tiresias")
    )
    sched.submit(gang("a", 2))
    sched.submit(gang("b", 2, arrival=10))
    sched.submit(gang("waiting", 8, arrival=20))  # does not fit; nobody elastic yet
    assert [p.job_id for p in sched.schedule(now=0).placements] == ["a", "b"]
    sched.set_elastic("a", 1, 4)
    sched.set_elastic("b", 1, 8)
    # a job waits: none grows (and a and b, in queue 0, do not shrink for it)
    assert sched.schedule(now=5).resize == {}
    sched.release("waiting")
    grow = sched.schedule(now=10).resize
    # 4 idle GPUs, one at a time to the larger gain; on a tie the earlier arrival (a)
    assert {j: n for j, (n, _) in grow.items()} == {"a": 4, "b": 4}
    assert sched.cluster.free_gpus() == 4  # proposals only: the gangs are placed as any gang
    assert sched.schedule(now=11).resize == {}  # asked once


def test_bounds_outside_one_to_max_are_refused() -> None:
    sched = GangScheduler(gpu_cluster())
    with pytest.raises(Exception, match=r"elastic bounds \[3, 2\]; need 1 <= min <= max"):
        sched.set_elastic("j", 3, 2)
