"""Group commit (services/store/group_commit.py) against the real MongoDB-wire servers.

Batches are made deterministic with a gate: the collection's first ``insert_many`` waits
until the other callers have queued behind it, so the second write is known to carry them
all. Everything else (the inserts, the unique indexes, the per-document write errors) is
the real server's.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pymongo.errors
import pytest

from services.store.group_commit import InsertBatcher
from services.store.jobs import JobRecord, JobsRepository, new_job_id

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def db(flavoured_db: Any) -> Any:
    return flavoured_db


class GatedCollection:
    """The real collection, whose first ``insert_many`` waits until ``release`` is set,
    so callers arriving meanwhile queue up for the next write. Optionally the second
    write lands only its first ``land_then_drop`` documents and then fails as a dropped
    connection would."""

    def __init__(self, col: Any, land_then_drop: int | None = None) -> None:
        self._col = col
        self.release = threading.Event()
        self.entered = threading.Event()
        self.calls: list[int] = []
        self._land_then_drop = land_then_drop

    def insert_many(self, docs: list[dict[str, Any]], ordered: bool = True) -> Any:
        self.calls.append(len(docs))
        if len(self.calls) == 1:
            self.entered.set()
            assert self.release.wait(10), "the test never released the first write"
        if len(self.calls) == 2 and self._land_then_drop is not None:
            self._col.insert_many(docs[: self._land_then_drop], ordered=ordered)
            raise pymongo.errors.AutoReconnect("connection dropped mid-write (test)")
        return self._col.insert_many(docs, ordered=ordered)

    def find(self, *args: Any, **kwargs: Any) -> Any:
        return self._col.find(*args, **kwargs)


def _queue_behind_a_held_write(
    batcher: InsertBatcher, gate: GatedCollection, docs: list[dict[str, Any]]
) -> list[BaseException | None]:
    """Insert docs[0] (held), then the rest from threads while it is held; release; return
    each document's outcome (None: stored)."""
    outcomes: list[BaseException | None] = [None] * len(docs)

    def insert(i: int) -> None:
        try:
            batcher.insert(docs[i])
        except BaseException as exc:  # recorded for the assertions
            outcomes[i] = exc

    with ThreadPoolExecutor(len(docs)) as pool:
        first = pool.submit(insert, 0)
        assert gate.entered.wait(10)
        rest = [pool.submit(insert, i) for i in range(1, len(docs))]
        _wait_until(lambda: len(batcher._queue) == len(docs) - 1)
        gate.release.set()
        for f in [first, *rest]:
            f.result(timeout=30)
    return outcomes


def _wait_until(cond: Any, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "callers never queued up"
        time.sleep(0.005)


def test_callers_that_arrive_during_a_write_share_the_next_one(db: Any) -> None:
    col = db["gc_share"]
    gate = GatedCollection(col)
    batcher = InsertBatcher(gate)  # type: ignore[arg-type]
    docs = [{"_id": f"share-{i}"} for i in range(9)]
    outcomes = _queue_behind_a_held_write(batcher, gate, docs)
    assert outcomes == [None] * 9
    assert gate.calls == [1, 8]  # the held one, then all eight that waited, together
    assert sorted(d["_id"] for d in col.find()) == sorted(d["_id"] for d in docs)


def test_a_failed_document_fails_only_its_own_caller(db: Any) -> None:
    col = db["gc_dup"]
    col.create_index("idem", unique=True, sparse=True)
    col.insert_one({"_id": "taken", "idem": "k"})
    gate = GatedCollection(col)
    batcher = InsertBatcher(gate)  # type: ignore[arg-type]
    docs = [{"_id": "first"}, {"_id": "a"}, {"_id": "dup", "idem": "k"}, {"_id": "b"}]
    outcomes = _queue_behind_a_held_write(batcher, gate, docs)
    assert gate.calls == [1, 3]
    assert isinstance(outcomes[2], pymongo.errors.DuplicateKeyError)
    assert [outcomes[i] for i in (0, 1, 3)] == [None, None, None]
    assert sorted(d["_id"] for d in col.find()) == ["a", "b", "first", "taken"]


def test_a_write_dropped_midway_acknowledges_what_landed_and_fails_the_rest(db: Any) -> None:
    col = db["gc_drop"]
    gate = GatedCollection(col, land_then_drop=2)
    batcher = InsertBatcher(gate)  # type: ignore[arg-type]
    docs = [{"_id": f"drop-{i}"} for i in range(5)]
    outcomes = _queue_behind_a_held_write(batcher, gate, docs)
    stored = {d["_id"] for d in col.find()}
    acknowledged = {docs[i]["_id"] for i, o in enumerate(outcomes) if o is None}
    # the held write and the two documents that landed before the drop are acknowledged
    # (which two of the four waiting threads queued first is theirs to choose)...
    assert outcomes[0] is None and len(acknowledged) == 3
    # ...exactly those are stored, and the others got the transient error to retry on
    assert stored == acknowledged
    assert all(isinstance(o, pymongo.errors.AutoReconnect) for o in outcomes if o is not None)


def _record(key: str = "", manifest: dict[str, Any] | None = None) -> JobRecord:
    return JobRecord(
        job_id=new_job_id(),
        owner="alice",
        name="j",
        manifest=manifest or {"name": "j", "framework": {"command": "true"}},
        resources={"learners": 1, "gpus": 0.0, "cpus": 1.0, "memory_mb": 256.0, "gpu_type": ""},
        idempotency_key=key,
    )


def test_concurrent_retries_of_one_keyed_submit_store_one_job(db: Any) -> None:
    repo = JobsRepository(db)
    repo.ensure_indexes()
    barrier = threading.Barrier(16)

    def submit(_: int) -> tuple[str, bool]:
        barrier.wait()
        job, existing = repo.create(_record(key="retry-storm"))
        return job.job_id, existing

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(submit, range(16)))
    ids = {job_id for job_id, _ in results}
    assert len(ids) == 1, f"one key made {len(ids)} jobs"
    assert sorted(existing for _, existing in results) == [False] + [True] * 15
    assert db["jobs"].count_documents({"idem": "alice\x1fretry-storm"}) == 1


def test_a_retry_that_finds_its_own_landed_document_is_acknowledged(db: Any) -> None:
    # The insert landed but the caller saw the connection drop: its retry meets its own
    # _id, which is success, not a duplicate submit.
    repo = JobsRepository(db)
    repo.ensure_indexes()
    record = _record()
    db["jobs"].insert_one({"_id": record.job_id, "job_id": record.job_id, "owner": "alice"})
    job, existing = repo.create(record)
    assert (job.job_id, existing) == (record.job_id, False)


def test_many_concurrent_submits_are_each_stored_once(db: Any) -> None:
    repo = JobsRepository(db)
    repo.ensure_indexes()
    with ThreadPoolExecutor(16) as pool:
        made = list(pool.map(lambda _: repo.create(_record())[0].job_id, range(200)))
    assert len(set(made)) == 200
    assert db["jobs"].count_documents({"_id": {"$in": made}}) == 200
    assert repo._batcher is not None and repo._batcher.documents == 200


class DroppingCollection:
    """The real collection, whose first `drops` writes fail as a dropped connection
    would, with nothing stored."""

    def __init__(self, col: Any, drops: int) -> None:
        self._col = col
        self.drops = drops
        self.calls = 0

    def insert_many(self, docs: list[dict[str, Any]], ordered: bool = True) -> Any:
        self.calls += 1
        if self.calls <= self.drops:
            raise pymongo.errors.AutoReconnect("connection dropped before the write (test)")
        return self._col.insert_many(docs, ordered=ordered)

    def find(self, *args: Any, **kwargs: Any) -> Any:
        return self._col.find(*args, **kwargs)


@pytest.mark.parametrize("drops", [1, 3])
def test_a_submit_whose_write_is_dropped_is_retried_and_stored_once(db: Any, drops: int) -> None:
    # The first attempt runs outside the retry machinery (JobsRepository._insert); a
    # transient failure of it, or of the retries after it, is still retried.
    repo = JobsRepository(db)
    repo.ensure_indexes()
    dropping = DroppingCollection(db["jobs"], drops)
    repo._batcher = InsertBatcher(dropping)  # type: ignore[arg-type]
    record = _record()
    job, existing = repo.create(record)
    assert (job.job_id, existing) == (record.job_id, False)
    assert dropping.calls == drops + 1
    assert db["jobs"].count_documents({"_id": record.job_id}) == 1
