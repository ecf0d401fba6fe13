from __future__ import annotations

from pathlib import Path

import pytest

from services.scheduler.api import JobRequest, QuotaConfigError, SchedState
from services.scheduler.quota import load_quota_config, quota_config_from_mapping
from services.scheduler.scheduler import GangScheduler
from tests.services.scheduler.conftest import gpu_cluster


def _job(
    job_id: str, owner: str, learners: int, gpus: int, arrival: float, priority: int = 0
) -> JobRequest:
    return JobRequest(
        job_id,
        learners=learners,
        gpus=gpus,
        gpu_type="V100",
        owner=owner,
        arrival=arrival,
        priority=priority,
    )


QUOTAS = {"users": {"alice": {"quota": {"V100": 8}}, "bob": {"quota": {"V100": 8}}}}


def test_borrowing_job_is_preempted_when_the_quota_owner_needs_it() -> None:
    quotas = quota_config_from_mapping(QUOTAS, ["V100"])
    sched = GangScheduler(gpu_cluster(nodes=4, gpus=4), quotas=quotas, clock=lambda: 0.0)
    sched.submit(_job("bob-own", "bob", 2, 4, arrival=0))
    sched.submit(_job("bob-borrow", "bob", 2, 4, arrival=10))
    placed = sched.schedule().placements
    assert [(p.job_id, p.borrowing) for p in placed] == [("bob-own", False), ("bob-borrow", True)]
    assert "borrows idle V100 quota" in sched.explain("bob-borrow")
    sched.submit(_job("alice-job", "alice", 2, 4, arrival=20))
    result = sched.schedule()
    assert result.preempted == ["bob-borrow"]
    assert [p.job_id for p in result.placements] == ["alice-job"]
    # halted, not lost: queued again with its history
    assert sched.state("bob-borrow") == SchedState.QUEUED
    assert "halted 1 time" in sched.explain("bob-borrow")
    sched.release("alice-job")
    assert [p.job_id for p in sched.schedule().placements] == ["bob-borrow"]


def test_a_borrower_waiting_at_the_head_does_not_keep_the_quota_owner_waiting() -> None:
    # bob holds his quota and borrows alice's idle half; his next borrower waits at the
    # head of the pool (older than alice's job): alice's job, within her quota, must
    # still preempt the placed borrower instead of queueing behind the waiting one
    quotas = quota_config_from_mapping(QUOTAS, ["V100"])
    sched = GangScheduler(gpu_cluster(nodes=4, gpus=4), quotas=quotas, clock=lambda: 0.0)
    sched.submit(_job("bob-own", "bob", 2, 4, arrival=0))
    sched.submit(_job("bob-borrow", "bob", 2, 4, arrival=1))
    assert len(sched.schedule().placements) == 2
    sched.submit(_job("bob-more", "bob", 2, 4, arrival=10))  # borrows too: no room
    sched.submit(_job("alice-job", "alice", 2, 4, arrival=20))
    result = sched.schedule()
    assert result.preempted == ["bob-borrow"]
    assert [p.job_id for p in result.placements] == ["alice-job"]
    assert sched.state("bob-more") == SchedState.QUEUED


def test_a_guaranteed_job_never_preempts_another_guaranteed_job() -> None:
    quotas = quota_config_from_mapping(QUOTAS, ["V100"])
    sched = GangScheduler(gpu_cluster(nodes=4, gpus=4), quotas=quotas, clock=lambda: 0.0)
    sched.submit(_job("a", "alice", 2, 4, arrival=0))
    sched.submit(_job("b", "bob", 2, 4, arrival=0))
    sched.schedule()
    sched.submit(_job("a2", "alice", 1, 4, arrival=5))  # beyond quota: would borrow, no room
    result = sched.schedule()
    assert result.preempted == [] and result.placements == []


def test_hard_limit_holds_a_job_and_refuses_one_larger_than_the_limit() -> None:
    quotas = quota_config_from_mapping(
        {"users": {"alice": {"quota": {"V100": 4}, "limit": {"V100": 8}}}}, ["V100"]
    )
    sched = GangScheduler(gpu_cluster(nodes=4, gpus=4), quotas=quotas, clock=lambda: 0.0)
    refused = sched.admit(_job("huge", "alice", 3, 4, arrival=0))
    assert not refused.admitted and "limit of alice is 8 V100" in refused.reason
    sched.submit(_job("a1", "alice", 2, 4, arrival=0))
    sched.submit(_job("a2", "alice", 1, 4, arrival=5))
    sched.submit(_job("other", "carol", 1, 4, arrival=9))
    placed = [p.job_id for p in sched.schedule().placements]
    assert placed == ["a1", "other"]  # a2 waits for alice's limit, not for the cluster
    assert "alice already uses 8 of a 8 V100 limit" in sched.explain("a2")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"user": {}}, "did you mean 'users'"),
        ({"users": {"a": {"quotas": {}}}}, "did you mean 'quota'"),
        ({"users": {"a": {"quota": {"V10": 2}}}}, "unknown GPU type 'V10'.*did you mean 'V100'"),
        ({"users": {"a": {"quota": {"V100": -1}}}}, "whole number"),
        ({"users": {"a": {"quota": {"V100": 4}, "limit": {"V100": 2}}}}, "below the quota"),
        ({"borrowing": "yes"}, "true or false"),
    ],
)
def test_quota_config_typos_are_clear_errors(raw: dict[str, object], message: str) -> None:
    with pytest.raises(QuotaConfigError, match=message):
        quota_config_from_mapping(raw, ["V100", "K80"])


def test_quota_config_loads_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "quota.yaml"
    path.write_text("borrowing: false\nusers:\n  alice:\n    quota: {V100: 4}\n")
    config = load_quota_config(path, ["V100"])
    assert config.quota("alice", "V100") == 4 and config.quota("bob", "V100") == 0
    assert config.borrowing is False
