"""The API of the daemon that hosts the scheduler calls it directly (issue #18):
`LocalScheduler` (services/scheduler/hosting.py) checks a submit before its job is stored
and hands the stored job to the scheduling loop, whose next pass queues it; no `Admit`
proto and no thread of its own in between. Real MongoDB-wire server."""

from __future__ import annotations

import threading

import pytest

from services.manifest import parse_manifest
from services.scheduler.cluster import Cluster, Node
from services.scheduler.hosting import LocalScheduler, SchedulingLoop
from services.scheduler.scheduler import GangScheduler
from services.scheduler.servicer import SchedulerServicer
from services.store import states
from services.store.jobs import JobRecord, JobsRepository, new_job_id

pytestmark = pytest.mark.integration

JOB = "name: j\nlearners: {learners}\ncpus: 1\nmemory: 512\nframework: {{command: 'true'}}\n"


@pytest.fixture
def repo(own_jobs: JobsRepository) -> JobsRepository:
    return own_jobs


def loop_over(repo: JobsRepository, nodes: int = 1) -> SchedulingLoop:
    """A loop that is not started: the test runs its passes."""
    cluster = Cluster([Node(f"n{i}", cpus=2, memory_mb=4096) for i in range(nodes)])
    scheduler = GangScheduler(cluster)
    return SchedulingLoop(scheduler, SchedulerServicer(scheduler), repo, None)


def stored(repo: JobsRepository, learners: int = 1) -> JobRecord:
    record = JobRecord.for_manifest(
        new_job_id(), "alice", parse_manifest(JOB.format(learners=learners))
    )
    job, _ = repo.create(record)
    return job


def test_a_job_that_can_never_run_is_refused_with_the_reason(repo: JobsRepository) -> None:
    local = LocalScheduler(loop_over(repo))
    admitted, reason = local.admit(stored(repo, learners=3))  # 2 CPUs, 1 each
    assert not admitted
    assert "can never run on this cluster" in reason
    assert local.admit(stored(repo, learners=2)) == (True, "")


def test_handed_over_jobs_are_queued_by_the_next_pass_in_order(repo: JobsRepository) -> None:
    loop = loop_over(repo)
    local = LocalScheduler(loop)
    jobs = [stored(repo) for _ in range(5)]
    for job in jobs:
        assert local.admit(job) == (True, "")
        local.queue(job)
    assert loop.wake.is_set()  # the loop is woken for them
    assert loop.scheduler.records == {}  # queued by the pass, not by the hand-over
    loop.run_pass()
    # 2 CPUs: the first two are placed (PENDING), the rest wait in the order they came
    assert [repo.get(j.job_id).status for j in jobs[:2]] == [states.PENDING] * 2
    assert loop.scheduler.queued() == [j.job_id for j in jobs[2:]]


def test_a_hand_over_does_not_wait_for_a_pass(repo: JobsRepository) -> None:
    loop = loop_over(repo)
    local = LocalScheduler(loop)
    job = stored(repo)
    handed = threading.Event()

    def hand_over() -> None:
        local.queue(job)
        handed.set()

    with loop.lock:  # a pass in progress holds it
        worker = threading.Thread(target=hand_over)
        worker.start()
        assert handed.wait(10)
    worker.join()
    loop.run_pass()
    assert repo.get(job.job_id).status == states.PENDING


def test_a_job_the_scheduler_refuses_when_queued_fails_and_the_rest_are_queued(
    repo: JobsRepository,
) -> None:
    loop = loop_over(repo, nodes=2)
    local = LocalScheduler(loop)
    big, small = stored(repo, learners=3), stored(repo)
    assert local.admit(big) == (True, "")  # fits on two nodes (1 CPU each)
    # a node leaves the model between the check and the queueing: now it never fits
    loop.scheduler.replace_nodes([Node("n0", cpus=2, memory_mb=4096)])
    local.queue(big)
    local.queue(small)
    loop.run_pass()
    failed = repo.get(big.job_id)
    assert failed.status == states.FAILED
    assert "cannot be scheduled" in failed.status_message
    assert "can never run on this cluster" in failed.status_message
    assert repo.get(small.job_id).status == states.PENDING


def test_a_job_handed_over_twice_or_also_found_by_the_resync_is_queued_once(
    repo: JobsRepository,
) -> None:
    loop = loop_over(repo)
    local = LocalScheduler(loop)
    jobs = [stored(repo) for _ in range(4)]  # 2 CPUs: two are placed, two wait
    for job in jobs:
        local.queue(job)
    local.queue(jobs[-1])  # handed over again (a resume's hand-over, say)
    loop.run_pass()  # the hand-overs, then the first resync: it finds the two QUEUED
    local.queue(jobs[-1])
    loop.run_pass()
    assert loop.scheduler.queued() == [j.job_id for j in jobs[2:]]
