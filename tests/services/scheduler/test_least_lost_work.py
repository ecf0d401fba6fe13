"""Giving quota back loses as little work as possible (issue #19): borrowing elastic jobs
shrink first (as little as makes room); whole gangs are preempted only when shrinking
cannot make room, and among them the one that loses the least work since its last
checkpoint goes first (unit tests on the GangScheduler)."""

from __future__ import annotations

from services.scheduler.api import JobRequest
from services.scheduler.quota import quota_config_from_mapping
from services.scheduler.scheduler import GangScheduler
from tests.services.scheduler.conftest import gpu_cluster

# alice owns the 8 GPUs; bob has no quota and borrows
QUOTAS = {"users": {"alice": {"quota": {"V100": 8}}, "bob": {"quota": {}}}}


def job(job_id: str, owner: str, learners: int, arrival: float) -> JobRequest:
    return JobRequest(job_id, learners=learners, gpus=1, gpu_type="V100", owner=owner,
                      arrival=arrival)  # fmt: skip


def scheduler(now: list[float]) -> GangScheduler:
    quotas = quota_config_from_mapping(QUOTAS, ["V100"])
    return GangScheduler(gpu_cluster(nodes=2, gpus=4), quotas=quotas, clock=lambda: now[0])


def test_the_victim_that_checkpointed_last_goes_first_not_the_newest() -> None:
    sched = scheduler([0.0])
    sched.submit(job("old", "bob", 4, arrival=0))
    assert [p.job_id for p in sched.schedule(now=0).placements] == ["old"]
    sched.submit(job("new", "bob", 4, arrival=100))
    assert [p.job_id for p in sched.schedule(now=100).placements] == ["new"]
    # "old" saved a checkpoint at 990: it would lose 10 s of work; "new" never saved and
    # would lose everything since 100. The previous rule took the newest ("new").
    sched.note_checkpoint("old", 990.0)
    sched.submit(job("alice", "alice", 4, arrival=1000))
    result = sched.schedule(now=1000)
    assert result.preempted == ["old"]
    assert [p.job_id for p in result.placements] == ["alice"]


def test_without_checkpoints_the_most_recently_placed_loses_the_least() -> None:
    sched = scheduler([0.0])
    sched.submit(job("old", "bob", 4, arrival=0))
    sched.schedule(now=0)
    sched.submit(job("new", "bob", 4, arrival=100))
    sched.schedule(now=100)
    sched.submit(job("alice", "alice", 4, arrival=1000))
    assert sched.schedule(now=1000).preempted == ["new"]


def test_a_borrowing_elastic_job_shrinks_instead_of_being_preempted() -> None:
    sched = scheduler([0.0])
    sched.submit(job("bob-elastic", "bob", 8, arrival=0))
    sched.schedule(now=0)
    sched.set_elastic("bob-elastic", 2, 8)
    sched.submit(job("alice", "alice", 3, arrival=10))
    result = sched.schedule(now=10)
    assert result.preempted == [] and result.placements == []
    # as little as makes room: 8 -> 5 learners, not to its minimum
    learners, reason = result.resize["bob-elastic"]
    assert learners == 5 and "quota reclaim" in reason
    assert "waiting for elastic job bob-elastic to shrink" in sched.explain("alice")
    sched.resize("bob-elastic", 5)  # the guardian retired three learners
    result = sched.schedule(now=11)
    assert [p.job_id for p in result.placements] == ["alice"] and result.preempted == []


def test_an_elastic_job_that_cannot_shrink_enough_is_preempted_whole() -> None:
    sched = scheduler([0.0])
    sched.submit(job("bob-elastic", "bob", 8, arrival=0))
    sched.schedule(now=0)
    sched.set_elastic("bob-elastic", 7, 8)  # at most one learner to give back
    sched.submit(job("alice", "alice", 4, arrival=10))
    result = sched.schedule(now=10)
    assert result.resize == {}
    assert result.preempted == ["bob-elastic"]
    assert [p.job_id for p in result.placements] == ["alice"]
