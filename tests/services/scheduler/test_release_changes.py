"""The scheduling loop's release check is driven by changes (issue #18: every placed job's
whole record, read twice a second, was the daemon's largest steady cost per alive job):
it reads the records written since its last read (`JobsRepository.written_since`, with a
look-back) and those of jobs placed since, and every `full_release_read_s` (and at its
first check) every placed job's record, the safety net. Real MongoDB-wire server; the
passes are called by the test, each with its release check (RELEASE_INTERVAL_S = 0)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import pytest

from contract.checkpoints import CheckpointReport
from services.manifest import parse_manifest
from services.scheduler import hosting
from services.scheduler.api import JobRequest
from services.scheduler.hosting import SchedulingLoop
from services.scheduler.scheduler import GangScheduler
from services.scheduler.servicer import SchedulerServicer
from services.store import states
from services.store.jobs import JobRecord, JobsRepository, new_job_id
from services.store.mongo import connect
from tests.services.scheduler.conftest import gpu_cluster

pytestmark = pytest.mark.integration


class CountingRepo:
    """The loop's jobs repository, counting the whole records it reads (`get_many`) and
    the change reads it makes (`written_since`)."""

    def __init__(self, repo: JobsRepository) -> None:
        self._repo = repo
        self.records_read: list[str] = []
        self.change_reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._repo, name)

    def get_many(self, job_ids: Any) -> list[JobRecord]:
        found = self._repo.get_many(job_ids)
        self.records_read.extend(j.job_id for j in found)
        return found

    def written_since(self, since: float) -> dict[str, float]:
        self.change_reads += 1
        return self._repo.written_since(since)


def running(repo: JobsRepository, learners: int = 1, elastic: bool = False) -> str:
    """A PROCESSING job's record, placed on n0."""
    doc: dict[str, Any] = {"name": "r", "learners": learners, "gpus": 1, "gpu_type": "V100",
                           "framework": {"command": "true"}}  # fmt: skip
    if elastic:
        doc["elastic"] = {"min": 1, "max": 4}
    job_id = new_job_id()
    repo.create(JobRecord.for_manifest(job_id, "alice", parse_manifest(json.dumps(doc))))
    nodes = {str(r): "n0" for r in range(learners)}
    repo.transition(job_id, states.PENDING, "placed", placement={"learner_nodes": nodes})
    for status in (states.DEPLOYING, states.PROCESSING):
        repo.transition(job_id, status, status.lower())
    return job_id


@pytest.fixture
def repo(stores: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[JobsRepository]:
    """A database of its own (the first check reads every placed job, the resync every
    QUEUED one in it), and a release check in every pass."""
    monkeypatch.setattr(hosting, "RELEASE_INTERVAL_S", 0.0)
    db = connect(stores["mongo_url"], f"release_changes_{uuid.uuid4().hex[:8]}")
    repository = JobsRepository(db)
    repository.ensure_indexes()
    yield repository
    db.client.close()


def placed_loop(
    repo: JobsRepository, jobs: dict[str, int]
) -> tuple[GangScheduler, SchedulingLoop, CountingRepo]:
    """A loop over a scheduler that holds `jobs` ({job: learners}) on one 4-GPU node, whose
    full reads come only when the test asks (the first check is one)."""
    scheduler = GangScheduler(gpu_cluster(nodes=1, gpus=4))
    for job_id, learners in jobs.items():
        scheduler.submit(JobRequest(job_id, learners=learners, gpus=1, gpu_type="V100"))
    scheduler.schedule(now=0)
    counting = CountingRepo(repo)
    loop = SchedulingLoop(scheduler, SchedulerServicer(scheduler), counting, None)  # type: ignore[arg-type]
    loop.full_release_read_s = 3600.0
    return scheduler, loop, counting


def check(loop: SchedulingLoop, counting: CountingRepo) -> list[str]:
    """One pass with its release check: the records it read."""
    counting.records_read.clear()
    loop.run_pass()
    return sorted(counting.records_read)


def placed(scheduler: GangScheduler) -> set[str]:
    return {p.job_id for p in scheduler.placements()}


def test_a_placement_is_released_in_the_check_after_its_job_ends(
    repo: JobsRepository,
) -> None:
    a, b = running(repo), running(repo)
    scheduler, loop, counting = placed_loop(repo, {a: 1, b: 1})
    assert check(loop, counting) == sorted([a, b])  # the first check reads every placed job
    # Nothing written: no record read (the look-back's stamps are those already read)
    assert check(loop, counting) == []
    assert counting.change_reads >= 1
    assert check(loop, counting) == []
    # One job ends: its record only, and its placement is released
    repo.transition(a, states.COMPLETED, "done")
    assert check(loop, counting) == [a]
    assert placed(scheduler) == {b}
    # Its write is still inside the look-back: not read again
    assert check(loop, counting) == []


def test_a_change_the_look_back_missed_is_released_by_the_full_read(
    repo: JobsRepository,
) -> None:
    a, b = running(repo), running(repo)
    scheduler, loop, counting = placed_loop(repo, {a: 1, b: 1})
    check(loop, counting)
    # A write that landed long after its stamp (or from a clock far behind): the change
    # read does not see it...
    late = {"status": states.FAILED, "updated_at": 1.0, "touched_at": 1.0}  # both stamps
    repo._col.update_one({"_id": a}, {"$set": late})
    assert check(loop, counting) == []
    assert placed(scheduler) == {a, b}
    # ...the next full read does
    loop._full_read_at = float("-inf")
    assert check(loop, counting) == sorted([a, b])
    assert placed(scheduler) == {b}


def test_a_job_placed_after_the_last_read_is_read_once(
    repo: JobsRepository,
) -> None:
    a = running(repo)
    scheduler, loop, counting = placed_loop(repo, {a: 1})
    check(loop, counting)
    # Placed since, its record written long before (a job the scheduler placed whose
    # record had moved on): read because it is new to the check, then released
    b = running(repo)
    repo._col.update_one({"_id": b}, {"$set": {"status": states.HALTED, "updated_at": 1.0}})
    scheduler.submit(JobRequest(b, learners=1, gpus=1, gpu_type="V100"))
    scheduler.schedule(now=1)
    assert check(loop, counting) == [b]
    assert placed(scheduler) == {a}


def test_an_elastic_jobs_shrink_frees_the_rest_through_the_change_read(
    repo: JobsRepository,
) -> None:
    job_id = running(repo, learners=2, elastic=True)
    scheduler, loop, counting = placed_loop(repo, {job_id: 2})
    check(loop, counting)
    assert check(loop, counting) == []
    repo.update_fields(job_id, **{"resources.learners": 1})  # the guardian retired rank 1
    assert check(loop, counting) == [job_id]
    assert scheduler.job_size(job_id) == 1
    assert scheduler.cluster.free_gpus() == 3


def test_a_reported_checkpoint_reaches_the_scheduler_through_the_change_read(
    repo: JobsRepository,
) -> None:
    job_id = running(repo)
    scheduler, loop, counting = placed_loop(repo, {job_id: 1})
    check(loop, counting)
    assert job_id not in scheduler.elasticity.checkpoints
    # The TDS's write of a checkpoint report (it moves `updated_at`, not `version`)
    report = CheckpointReport(kind="periodic", step=5, size_bytes=10, time=4321.0)
    assert repo.add_checkpoints(job_id, [asdict(report)])
    assert check(loop, counting) == [job_id]
    assert scheduler.elasticity.checkpoints[job_id] == 4321.0
