"""The scheduling loop's resync with the QUEUED records reads every QUEUED id only at its
first pass and every `full_resync_interval_s` (4,000 ids cost the MongoDB-wire server
150 ms, every insert waiting behind it: issue #18); in between it reads the ids after
the newest job it queued, and a queued job whose record leaves QUEUED leaves the queue
at the next release check, from the records written since the last look. Real
MongoDB-wire server; the passes are called by the test."""

from __future__ import annotations

from typing import Any

import pytest

from services.manifest import parse_manifest
from services.scheduler import hosting
from services.scheduler.cluster import Cluster, Node
from services.scheduler.hosting import LocalScheduler, SchedulingLoop
from services.scheduler.requests import job_request
from services.scheduler.scheduler import GangScheduler
from services.scheduler.servicer import SchedulerServicer
from services.store import states
from services.store.jobs import JobRecord, JobsRepository, new_job_id

pytestmark = pytest.mark.integration

JOB = "name: j\nlearners: 1\ncpus: 1\nmemory: 512\nframework: {command: 'true'}\n"


class CountingRepo:
    """The loop's jobs repository, recording how many ids each QUEUED-id read returned."""

    def __init__(self, repo: JobsRepository) -> None:
        self._repo = repo
        self.id_reads: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._repo, name)

    def ids_by_status(self, statuses: Any, after: str = "") -> list[str]:
        found = self._repo.ids_by_status(statuses, after)
        self.id_reads.append(len(found))
        return found


@pytest.fixture
def repo(own_jobs: JobsRepository, monkeypatch: pytest.MonkeyPatch) -> JobsRepository:
    # a resync and a release check in every pass
    monkeypatch.setattr(hosting, "RESYNC_INTERVAL_S", 0.0)
    monkeypatch.setattr(hosting, "RELEASE_INTERVAL_S", 0.0)
    return own_jobs


def stored(repo: JobsRepository, job_id: str = "") -> JobRecord:
    record = JobRecord.for_manifest(job_id or new_job_id(), "alice", parse_manifest(JOB))
    return repo.create(record)[0]


def full_loop(repo: JobsRepository) -> tuple[SchedulingLoop, CountingRepo]:
    """A loop on a node with room for one job, which a job placed before holds (every job
    stored stays queued)."""
    scheduler = GangScheduler(Cluster([Node("n0", cpus=1, memory_mb=1024)]))
    blocker = stored(repo)
    repo.transition(blocker.job_id, states.PENDING, "placed")
    scheduler.submit(job_request(blocker))
    scheduler.schedule()
    counting = CountingRepo(repo)
    loop = SchedulingLoop(scheduler, SchedulerServicer(scheduler), counting, None)  # type: ignore[arg-type]
    loop.full_resync_interval_s = 3600.0  # the first pass's only, unless the test says
    return loop, counting


def test_between_full_reads_only_the_ids_after_the_newest_queued_are_read(
    repo: JobsRepository,
) -> None:
    waiting = [stored(repo) for _ in range(30)]
    loop, counting = full_loop(repo)
    loop.run_pass()  # the first resync reads every QUEUED id and queues them
    assert counting.id_reads == [30]
    assert loop.scheduler.queued() == [j.job_id for j in waiting]
    loop.run_pass()
    assert counting.id_reads[-1] == 0  # nothing newer than the newest queued
    lost = stored(repo)  # stored, its hand-over never came
    loop.run_pass()
    assert counting.id_reads[-1] == 1
    assert loop.scheduler.queued()[-1] == lost.job_id


def test_a_lost_job_older_than_the_newest_queued_joins_at_the_next_full_read(
    repo: JobsRepository,
) -> None:
    loop, counting = full_loop(repo)
    newest = stored(repo)
    loop.run_pass()
    assert loop.scheduler.queued() == [newest.job_id]
    older = stored(repo, job_id="0" + newest.job_id)  # as from a daemon whose clock is behind
    loop.run_pass()
    assert older.job_id not in loop.scheduler.queued()
    loop.full_resync_interval_s = 0.0
    loop.run_pass()
    assert counting.id_reads[-1] == 2
    assert older.job_id in loop.scheduler.queued()


@pytest.mark.parametrize("leaves_by", [states.DELETED, states.HALTED])
def test_a_queued_job_whose_record_leaves_queued_leaves_the_queue_at_the_next_check(
    repo: JobsRepository, leaves_by: str
) -> None:
    jobs = [stored(repo) for _ in range(3)]
    loop, counting = full_loop(repo)
    loop.run_pass()
    repo.transition(jobs[1].job_id, leaves_by, "by the user")
    reads = len(counting.id_reads)
    loop.run_pass()
    assert loop.scheduler.queued() == [jobs[0].job_id, jobs[2].job_id]
    assert counting.id_reads[reads:] == [0]  # no full read needed it
    # the record's write is seen once: the next check reads no record of it again
    loop.run_pass()
    assert loop.scheduler.queued() == [jobs[0].job_id, jobs[2].job_id]


def test_a_halted_job_resumed_and_handed_over_joins_again(repo: JobsRepository) -> None:
    job = stored(repo)
    loop, _ = full_loop(repo)
    loop.run_pass()
    repo.transition(job.job_id, states.HALTED, "halted by user")
    loop.run_pass()
    assert loop.scheduler.queued() == []
    repo.transition(job.job_id, states.QUEUED, "resumed by user")
    LocalScheduler(loop).queue(repo.get(job.job_id))
    loop.run_pass()
    loop.run_pass()  # its record's write (the resume) is seen, and it is still QUEUED
    assert loop.scheduler.queued() == [job.job_id]


def test_a_queued_job_written_but_still_queued_stays(repo: JobsRepository) -> None:
    jobs = [stored(repo) for _ in range(2)]
    loop, _ = full_loop(repo)
    loop.run_pass()
    repo.update_fields(jobs[0].job_id, queue_reason="waits for room")
    loop.run_pass()
    assert loop.scheduler.queued() == [j.job_id for j in jobs]
