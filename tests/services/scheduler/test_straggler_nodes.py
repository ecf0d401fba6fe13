"""A node where a straggler was reported is left out of the next placements when the gang
fits elsewhere, and only for a while (unit tests on the GangScheduler)."""

from __future__ import annotations

from services.scheduler.api import JobRequest
from services.scheduler.scheduler import STRAGGLER_AVOID_S, GangScheduler
from tests.services.scheduler.conftest import gpu_cluster


def job(job_id: str, learners: int, arrival: float) -> JobRequest:
    return JobRequest(job_id, learners=learners, gpus=1, gpu_type="V100", arrival=arrival)


def test_the_next_placement_avoids_the_node_of_a_straggler() -> None:
    now = [0.0]
    sched = GangScheduler(gpu_cluster(nodes=2, gpus=4), clock=lambda: now[0])
    sched.submit(job("before", 4, arrival=0))
    # PACK fills the first node it picks; with n0 avoided, the gang goes to n1
    first = sched.schedule(now=0).placements[0].learner_nodes
    sched.release("before")
    straggling = first[0]
    sched.avoid_node(straggling)
    sched.submit(job("after", 4, arrival=10))
    placed = sched.schedule(now=10).placements[0].learner_nodes
    assert straggling not in placed


def test_a_gang_that_fits_only_with_the_avoided_node_is_still_placed() -> None:
    sched = GangScheduler(gpu_cluster(nodes=2, gpus=4), clock=lambda: 0.0)
    sched.avoid_node("n0")
    sched.submit(job("wide", 8, arrival=0))
    assert sorted(set(sched.schedule(now=0).placements[0].learner_nodes)) == ["n0", "n1"]


def test_the_node_is_avoided_only_for_a_while() -> None:
    now = [0.0]
    sched = GangScheduler(gpu_cluster(nodes=2, gpus=4), clock=lambda: now[0])
    sched.avoid_node("n0")
    assert sched._avoided_now() == {0}
    now[0] = STRAGGLER_AVOID_S + 1
    assert sched._avoided_now() == set() and sched.avoided == {}
