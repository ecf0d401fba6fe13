"""JobsRepository.set_last_metrics against the real MongoDB-wire server: newest value per
name, bounded, and without moving the record's version (a guardian's fencing token)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.embedded.process import ManagedServer
from services.store.jobs import MAX_LAST_METRICS, JobRecord, JobsRepository, new_job_id
from services.store.mongo import connect
from tests.services.store.test_jobs import record

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def repo(mongo_server: ManagedServer) -> Iterator[JobsRepository]:
    db = connect(mongo_server.url.replace("/?", "/last_metrics?"))
    repository = JobsRepository(db)
    repository.ensure_indexes()
    yield repository
    db.client.close()


def new_job(repo: JobsRepository) -> JobRecord:
    return repo.create(record())[0]


def row(name: str, value: float, at: float, step: int = 1) -> dict[str, object]:
    return {"name": name, "value": value, "step": step, "time": at, "learner": 0}


def test_last_metrics_keep_the_newest_value_per_name_and_leave_the_version(
    repo: JobsRepository,
) -> None:
    job = new_job(repo)
    assert repo.set_last_metrics(job.job_id, [row("loss", 0.9, 10.0), row("a.b", 1.0, 10.0)])
    # A later write merges: newer loss wins, an older accuracy loses, dotted names survive.
    assert repo.set_last_metrics(job.job_id, [row("loss", 0.4, 11.0, 2), row("a.b", 9.0, 5.0)])
    stored = repo.get(job.job_id)
    assert {m["name"]: m["value"] for m in stored.last_metrics} == {"loss": 0.4, "a.b": 1.0}
    assert stored.version == job.version  # a fenced status write is not made stale
    assert stored.updated_at == job.updated_at


def test_last_metrics_are_bounded_to_the_most_recent_names(repo: JobsRepository) -> None:
    job = new_job(repo)
    many = [row(f"m{i:02d}", float(i), 100.0 + i) for i in range(MAX_LAST_METRICS + 4)]
    repo.set_last_metrics(job.job_id, many)
    names = {m["name"] for m in repo.get(job.job_id).last_metrics}
    assert names == {f"m{i:02d}" for i in range(4, MAX_LAST_METRICS + 4)}


def test_last_metrics_of_a_job_not_stored_are_refused_quietly(repo: JobsRepository) -> None:
    assert not repo.set_last_metrics(new_job_id(), [row("loss", 1.0, 1.0)])


def test_a_listing_carries_the_last_metrics_but_not_the_checkpoint_list(
    repo: JobsRepository,
) -> None:
    job = new_job(repo)
    repo.set_last_metrics(job.job_id, [row("loss", 0.5, 10.0)])
    save = {"kind": "periodic", "step": 1, "size_bytes": 9, "time": 10.0, "learner": "0"}
    assert repo.add_checkpoints(job.job_id, [save, dict(save)])  # shipped twice: kept once
    listed = next(j for j in repo.list_page("alice", page_size=500).jobs if j.job_id == job.job_id)
    assert [m["name"] for m in listed.last_metrics] == ["loss"]
    assert listed.checkpoints == []
    assert [c["step"] for c in repo.get(job.job_id).checkpoints] == [1]


def test_checkpoint_reports_merged_at_the_same_instant_are_all_kept(repo: JobsRepository) -> None:
    """The TDS merges reports from its thread pool; the learners of a pipeline job report
    their emergency saves at one instant. A merge must not write over another's."""
    import threading

    for _ in range(5):
        job = new_job(repo)
        start = threading.Barrier(8)

        def report(
            learner: int, job_id: str = job.job_id, start: threading.Barrier = start
        ) -> None:
            save = {"kind": "emergency", "step": 7, "size_bytes": 9, "time": 10.0 + learner,
                    "learner": str(learner), "name": f"s7-{learner}"}  # fmt: skip
            start.wait()
            repo.add_checkpoints(job_id, [save])

        threads = [threading.Thread(target=report, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        kept = sorted(c["learner"] for c in repo.get(job.job_id).checkpoints)
        assert kept == [str(n) for n in range(8)], kept
