"""JobsRepository against both real MongoDB-wire servers (SecantusDB and nx-27017)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from services.store import states
from services.store.errors import IdempotencyConflict, JobNotFound, StaleToken
from services.store.jobs import JobRecord, JobsRepository

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def repo(flavoured_db: Any) -> JobsRepository:
    repository = JobsRepository(flavoured_db)
    repository.ensure_indexes()
    return repository


_counter = iter(range(1_000_000))


def record(
    owner: str = "alice", key: str = "", manifest: dict[str, Any] | None = None
) -> JobRecord:
    n = next(_counter)
    from services.store.jobs import new_job_id

    return JobRecord(
        job_id=new_job_id(),
        owner=owner,
        name=f"job{n}",
        manifest=manifest or {"name": f"job{n}", "framework": {"command": "true"}},
        resources={"learners": 1, "gpus": 0.0, "cpus": 1.0, "memory_mb": 256.0, "gpu_type": ""},
        idempotency_key=key,
    )


def test_create_stores_a_queued_job_with_its_first_history_entry(repo: JobsRepository) -> None:
    job, existing = repo.create(record())
    assert not existing
    stored = repo.get(job.job_id)
    assert stored.status == "QUEUED"
    assert [h.status for h in stored.history] == ["QUEUED"]
    assert stored.history[0].time == pytest.approx(stored.created_at)


def test_history_entries_stay_documents_through_transitions(repo: JobsRepository) -> None:
    job, _ = repo.create(record())
    for target in ("PENDING", "DEPLOYING", "PROCESSING", "COMPLETED"):
        repo.transition(job.job_id, target, f"to {target}")
    stored = repo.get(job.job_id)
    assert [h.status for h in stored.history] == [
        "QUEUED",
        "PENDING",
        "DEPLOYING",
        "PROCESSING",
        "COMPLETED",
    ]
    assert [h.message for h in stored.history][1:] == [
        "to PENDING",
        "to DEPLOYING",
        "to PROCESSING",
        "to COMPLETED",
    ]
    times = [h.time for h in stored.history]
    assert times == sorted(times)
    states.check_history([h.status for h in stored.history])


def test_an_illegal_transition_is_refused_and_nothing_is_written(repo: JobsRepository) -> None:
    job, _ = repo.create(record())
    with pytest.raises(states.IllegalTransition):
        repo.transition(job.job_id, "COMPLETED")
    stored = repo.get(job.job_id)
    assert stored.status == "QUEUED"
    assert len(stored.history) == 1
    assert stored.version == job.version


def test_a_stale_fencing_token_loses(repo: JobsRepository) -> None:
    job, _ = repo.create(record())
    repo.transition(job.job_id, "PENDING", expect_version=job.version)
    with pytest.raises(StaleToken):
        repo.transition(job.job_id, "HALTED", expect_version=job.version)
    assert repo.get(job.job_id).status == "PENDING"


def test_concurrent_writers_never_lose_a_history_entry(repo: JobsRepository) -> None:
    job, _ = repo.create(record())
    repo.transition(job.job_id, "PENDING")
    repo.transition(job.job_id, "DEPLOYING")
    repo.transition(job.job_id, "PROCESSING")
    results: list[str] = []

    def flip(target: str) -> None:
        try:
            repo.transition(job.job_id, target)
            results.append(target)
        except states.IllegalTransition:
            results.append("refused")

    # RECOVERING <-> PROCESSING flips race; every accepted one must be in the history once.
    threads = [threading.Thread(target=flip, args=(t,)) for t in ["RECOVERING", "HALTED"] * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stored = repo.get(job.job_id)
    accepted = [r for r in results if r != "refused"]
    assert len(stored.history) == 4 + len(accepted)
    states.check_history([h.status for h in stored.history])


def test_an_idempotency_key_returns_the_same_job(repo: JobsRepository) -> None:
    first, existing = repo.create(record(key="k-1"))
    assert not existing
    again, existing = repo.create(record(key="k-1", manifest=first.manifest))
    assert existing
    assert again.job_id == first.job_id
    assert len(repo.list_page("alice", name_prefix=first.name).jobs) == 1


def test_a_reused_key_with_another_manifest_is_a_conflict(repo: JobsRepository) -> None:
    first, _ = repo.create(record(key="k-2"))
    with pytest.raises(IdempotencyConflict, match="k-2"):
        repo.create(record(key="k-2", manifest={"name": "other", "framework": {"command": "x"}}))
    assert repo.get(first.job_id).status == "QUEUED"


def test_the_same_key_for_two_owners_is_two_jobs(repo: JobsRepository) -> None:
    a, _ = repo.create(record(owner="ann", key="shared"))
    b, existing = repo.create(record(owner="bob", key="shared"))
    assert not existing and a.job_id != b.job_id


def test_owners_see_only_their_jobs_and_unknown_ids_are_not_found(repo: JobsRepository) -> None:
    job, _ = repo.create(record(owner="carol"))
    with pytest.raises(JobNotFound):
        repo.get(job.job_id, owner="mallory")
    with pytest.raises(JobNotFound, match="no job 'job-nope'"):
        repo.get("job-nope")


def test_list_pages_newest_first_and_filters_by_status(repo: JobsRepository) -> None:
    ids = [repo.create(record(owner="dave"))[0].job_id for _ in range(7)]
    repo.transition(ids[0], "HALTED")
    seen: list[str] = []
    token = ""
    while True:
        page = repo.list_page("dave", page_size=3, page_token=token)
        seen += [j.job_id for j in page.jobs]
        token = page.next_page_token
        if not token:
            break
    assert seen == list(reversed(ids))
    halted = repo.list_page("dave", statuses=["HALTED"]).jobs
    assert [j.job_id for j in halted] == [ids[0]]


def test_queries_are_served_by_indexes(repo: JobsRepository) -> None:
    names = {tuple(k for k, _ in ix["key"].items()) for ix in repo._col.list_indexes()}
    assert ("owner", "job_id") in names
    assert ("status", "job_id") in names
    assert ("idem",) in names
    assert ("updated_at",) in names  # the listing index's refresh


def test_a_listing_sees_status_changes_and_new_jobs_written_by_another_process(
    repo: JobsRepository,
) -> None:
    # Two repositories over one database: the lister's index must learn what the other
    # (an LCM, another API daemon) wrote, through the indexed read of recent writes.
    lister = JobsRepository(repo._col.database)
    first = repo.create(record(owner="erin"))[0]
    assert [j.job_id for j in lister.list_page("erin").jobs] == [first.job_id]
    second = repo.create(record(owner="erin"))[0]
    repo.transition(first.job_id, "HALTED")
    assert [j.job_id for j in lister.list_page("erin").jobs] == [second.job_id, first.job_id]
    assert [j.job_id for j in lister.list_page("erin", statuses=["HALTED"]).jobs] == [first.job_id]
    assert [j.job_id for j in lister.list_page("erin", statuses=["QUEUED"]).jobs] == [second.job_id]
    assert lister.count("erin") == 2
    assert lister.count("erin", ["HALTED"]) == 1
    assert lister.count(None, ["HALTED"]) >= 1  # an admin's count spans every owner
    # The metrics gauges' counts come from the same index, refreshed.
    halted_before = lister.count_by_status()["HALTED"]
    repo.transition(second.job_id, "HALTED")
    assert lister.count_by_status()["HALTED"] == halted_before + 1


def test_a_status_the_index_has_not_seen_yet_never_shows_under_the_wrong_filter(
    repo: JobsRepository,
) -> None:
    job = repo.create(record(owner="frank"))[0]
    assert repo.list_page("frank", statuses=["QUEUED"]).jobs
    # A write that the index's refresh cannot see (an old updated_at): the page's records
    # are read again and checked, so the job is not listed as QUEUED any more.
    repo._col.update_one({"_id": job.job_id}, {"$set": {"status": "HALTED", "updated_at": 1.0}})
    assert repo.list_page("frank", statuses=["QUEUED"]).jobs == []
    # ... and the correction sticks: the job is now listed under its real status.
    assert [j.job_id for j in repo.list_page("frank", statuses=["HALTED"]).jobs] == [job.job_id]


def test_paging_with_filters_covers_every_match_once_and_skips_purged_jobs(
    repo: JobsRepository,
) -> None:
    made = []
    for i in range(9):
        r = record(owner="gina")
        r.name = f"{'keep' if i % 3 else 'other'}-{i}"
        made.append(repo.create(r)[0])
    repo.purge(made[4].job_id)
    wanted = [j.job_id for j in reversed(made) if j.name.startswith("keep") and j is not made[4]]
    seen: list[str] = []
    token = ""
    while True:
        page = repo.list_page("gina", name_prefix="keep", page_size=2, page_token=token)
        seen += [j.job_id for j in page.jobs]
        token = page.next_page_token
        if not token:
            break
    assert seen == wanted
    assert repo.count("gina", name_prefix="keep") == len(wanted)
