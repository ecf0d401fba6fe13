"""JobsRepository.written_since on each MongoDB-wire server: the records written after a
time, with their `updated_at`, for the scheduler's change-driven release check (issue
#18). Every write the check needs moves `updated_at`: a status, a field (a size, a
placement, a straggler, a scale gang) and a checkpoint report (the record's
`last_checkpoint`, the preemption victim's lost work); a metric does not, and neither
does the record's creation count (no placement holds a job not yet placed: a burst of
submits is not read by every check)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from services.store import states
from services.store.jobs import JobsRepository
from tests.services.store.test_jobs import record

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def repo(flavoured_db: Any) -> JobsRepository:
    repository = JobsRepository(flavoured_db.client[f"written_{uuid.uuid4().hex[:8]}"])
    repository.ensure_indexes()
    return repository


def new_job(repo: JobsRepository) -> str:
    return repo.create(record())[0].job_id


def test_written_since_gives_each_written_record_with_its_stamp(repo: JobsRepository) -> None:
    before = time.time() - 0.001
    a, b = new_job(repo), new_job(repo)
    assert not {a, b} & repo.written_since(before).keys()  # created, never written since
    time.sleep(0.002)
    repo.update_fields(a, queue_reason="waiting")
    written = repo.written_since(before)
    assert a in written and b not in written
    assert written[a] == repo.get(a).updated_at > repo.get(a).created_at
    after = time.time() + 0.001
    assert a not in repo.written_since(after)
    time.sleep(0.002)
    repo.transition(b, states.PENDING, "placed")
    moved = repo.written_since(after)
    assert b in moved and a not in moved
    assert moved[b] == repo.get(b).updated_at


def test_a_checkpoint_report_moves_updated_at_but_not_the_version(repo: JobsRepository) -> None:
    job_id = new_job(repo)
    job = repo.get(job_id)
    since = time.time() + 0.001
    time.sleep(0.002)
    save = {"kind": "periodic", "step": 3, "size_bytes": 9, "time": 12.0, "learner": "0"}
    assert repo.add_checkpoints(job_id, [save])
    stored = repo.get(job_id)
    assert stored.last_checkpoint == {"at": 12.0, "step": 3}
    assert stored.version == job.version  # a guardian's fenced write is not made stale
    assert stored.updated_at > job.updated_at
    assert repo.written_since(since) == {job_id: stored.updated_at}
    # the LCM's change read sees the same record (its status unchanged: nothing to do)
    assert (job_id, states.QUEUED) in repo.statuses_changed_since(since)


def test_a_metric_moves_neither(repo: JobsRepository) -> None:
    job_id = new_job(repo)
    since = time.time() + 0.001
    time.sleep(0.002)
    sample = {"name": "loss", "value": 0.5, "step": 1, "time": 10.0, "learner": 0}
    assert repo.set_last_metrics(job_id, [sample])
    assert job_id not in repo.written_since(since)
