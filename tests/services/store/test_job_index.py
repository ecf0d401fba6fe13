"""The jobs listing index (services/store/job_index.py), which the job gauges refresh
every 5 s, on each MongoDB-wire server: its counts by status are a full count's while
jobs are created and change status from several writers, and with writes that land late
(a writer's clock behind, a write that lands after its stamp); and a refresh no longer
reads again every record written in the whole look-back (issue #18: a burst of submits
was read by every refresh for 30 s)."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from typing import Any

import pytest

from services.store import states
from services.store.job_index import JobIndex
from services.store.jobs import JobsRepository
from tests.services.store.change_races import placed_late, write_while_reading
from tests.services.store.test_jobs import record

pytestmark = pytest.mark.integration

LOOKBACK_S, MARGIN_S, BAND_S = 4.0, 0.5, 1.0


class CountingReads:
    """The jobs collection, counting how often each record is returned by a read."""

    def __init__(self, col: Any) -> None:
        self._col = col
        self.returned: Counter[str] = Counter()

    def find(self, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        docs = list(self._col.find(*args, **kwargs))
        self.returned.update(str(d["_id"]) for d in docs)
        return docs


@pytest.fixture
def repo(flavoured_db: Any) -> JobsRepository:
    repository = JobsRepository(flavoured_db.client[f"index_{uuid.uuid4().hex[:8]}"])
    repository.ensure_indexes()
    return repository


def full_count(repo: JobsRepository) -> dict[str, int]:
    counts = Counter(str(d["status"]) for d in repo._col.find({}, {"status": 1}))
    return {s: counts.get(s, 0) for s in states.ALL_STATES}


def by_status(index: JobIndex) -> dict[str, int]:
    index.refresh()
    counts = index.count_by_status()
    return {s: counts.get(s, 0) for s in states.ALL_STATES}


def test_counts_by_status_are_a_full_counts_with_concurrent_and_late_writes(
    repo: JobsRepository,
) -> None:
    index = JobIndex(repo._col, lookback_s=LOOKBACK_S, margin_s=MARGIN_S, band_s=BAND_S)
    repo.create(record(owner="old"))  # before the index's first load
    assert by_status(index) == full_count(repo)

    def writer() -> None:
        for i in range(12):
            job_id = repo.create(record(owner="writer"))[0].job_id
            if i % 3:
                repo.transition(job_id, states.PENDING, "placed")
            if i % 4 == 0:
                repo.transition(job_id, states.HALTED, "halted")

    def late_writer() -> None:
        # A writer whose clock is 2 s behind (or whose writes land 2 s after their
        # stamps): its records and status changes arrive after the index's reads have
        # passed their stamps.
        for _ in range(6):
            behind = time.time() - 2.0
            placed_late(repo, repo.create(record(owner="late"))[0], behind)
            doc = record(owner="late").to_doc()
            doc.update(status=states.QUEUED, version=1, updated_at=behind, created_at=behind)
            repo._col.insert_one(doc)
            time.sleep(0.2)

    # by the band after the last stamp's look-back, the index has seen every write
    write_while_reading(
        index.refresh, [writer, writer, writer, writer, late_writer], LOOKBACK_S + BAND_S + 0.5
    )
    assert by_status(index) == full_count(repo)
    assert by_status(index)[states.PENDING] > 0


def test_a_burst_of_submits_is_read_about_twice_not_by_every_refresh(
    repo: JobsRepository,
) -> None:
    counting = CountingReads(repo._col)
    index = JobIndex(counting, lookback_s=LOOKBACK_S, margin_s=MARGIN_S, band_s=BAND_S)  # type: ignore[arg-type]
    index.refresh()
    burst = [repo.create(record(owner="burst"))[0].job_id for _ in range(40)]
    end = time.monotonic() + LOOKBACK_S + 2 * BAND_S
    while time.monotonic() < end:
        index.refresh()
        time.sleep(0.25)  # refreshes at least this far apart
    assert index.count("burst") == len(burst)
    # the fast reads from the refresh during its write to the first one that begins a
    # margin after it, and one band; reading the whole look-back each time (before),
    # LOOKBACK_S / 0.25 times
    most = int(MARGIN_S / 0.25) + 3
    assert max(counting.returned[j] for j in burst) <= most
