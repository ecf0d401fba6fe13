"""The LCM's rounds between its full ones are driven by changes (issue #18: a round over
every active job, five a second, was the daemon's largest steady cost per alive job):
they read the records written since the last round, not every active job's, and look
only at the jobs whose record or etcd keys changed, a job whose guardian exited, and
those something is counted in time for (no guardian yet). Every `full_round_s` a round
reads and looks at every active job again. Real etcd and MongoDB-wire server; the rounds
are called by the test, and `ensure_guardian` records instead of starting guardians."""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from contract import etcd_keys, procs
from services.lcm.manager import (
    CHANGES_BAND_S,
    CHANGES_MARGIN_S,
    LcmConfig,
    LifecycleManager,
    Supervised,
)
from services.store import states
from services.store.jobs import JobsRepository
from services.store.mongo import connect
from tests.services.guardian.helpers import submit, wait_for
from tests.services.lcm.recording_repo import RecordingRepo
from tests.services.store.change_races import placed_late, write_while_reading

pytestmark = pytest.mark.integration


def own_repo(stores: dict[str, Any]) -> JobsRepository:
    """A database of its own: a full round looks at every active job in it."""
    repo = JobsRepository(connect(stores["mongo_url"], f"lcm_changes_{uuid.uuid4().hex[:8]}"))
    repo.ensure_indexes()
    return repo


def looking_lcm(
    stores: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    jobs: JobsRepository,
    **config: Any,
) -> tuple[LifecycleManager, list[str]]:
    """An LCM on `jobs` whose rounds are the test's to call (only the first is a full
    one) and whose `ensure_guardian` records the jobs it looks at instead of starting
    guardians."""
    lcm = LifecycleManager(
        LcmConfig(
            tmp_path,
            stores["etcd_url"],
            stores["mongo_url"],
            place_locally=False,
            guardians_per_host=0,
            full_round_s=3600.0,
            **config,
        ),
        jobs,
        stores["etcd"],
    )
    me = procs.ProcRef.of(os.getpid())
    assert me is not None
    looked: list[str] = []

    def ensure_guardian(job_id: str, held: object, hostable: bool = False) -> None:
        # As a guardian process the LCM started: its exit would be the reaper's word.
        looked.append(job_id)
        lcm.guardians[job_id] = Supervised(job_id, me, child=True)

    monkeypatch.setattr(lcm, "ensure_guardian", ensure_guardian)
    return lcm, looked


def test_rounds_between_full_ones_look_only_at_what_changed(
    stores: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = own_repo(stores)
    recording = RecordingRepo(repo)
    lcm, looked = looking_lcm(stores, tmp_path, monkeypatch, recording)  # type: ignore[arg-type]

    def round_() -> list[str]:
        looked.clear()
        recording.calls.clear()
        lcm.reconcile()
        return sorted(looked)

    try:
        jobs = sorted(submit(repo, tmp_path, "true").job_id for _ in range(3))
        assert round_() == jobs  # the first round is a full one: every active job
        assert "manifests_by_status" in recording.calls

        # Nothing changed: no job looked at, no manifest read (the records written in the
        # last seconds are read again, ids and statuses only: the look-back)
        assert round_() == []
        assert "manifests_by_status" not in recording.calls
        assert "statuses_changed_since" in recording.calls
        assert round_() == []

        # One record changes: that job only
        repo.transition(jobs[0], states.DEPLOYING, "deploying")
        assert round_() == [jobs[0]]
        assert round_() == []

        # A new active job: looked at, its manifest read by id
        new = submit(repo, tmp_path, "true").job_id
        assert round_() == [new]
        assert "manifests_of" in recording.calls

        # A key of a job changes in etcd (the watched view): that job
        stores["etcd"].put(etcd_keys.learner_status(jobs[1], 0), {"status": "PROCESSING"})
        wait_for("the view to hear it", lambda: round_() == [jobs[1]], timeout_s=30)
        assert round_() == []

        # A job's guardian exited: it is looked at (restarted) in the next round
        lcm._guardian_exited(jobs[2], 999_999_999, 1)
        assert round_() == [jobs[2]]

        # A job leaves the active states: no longer looked at, forgotten by the round
        repo.transition(jobs[1], states.FAILED, "ended")
        round_()
        assert jobs[1] not in lcm._active

        # The safety net: a full round reads and looks at every active job again
        lcm._full_at = -1e9
        assert round_() == sorted([jobs[0], jobs[2], new])
        assert "manifests_by_status" in recording.calls
    finally:
        stores["etcd"].delete_prefix(etcd_keys.job_prefix(jobs[1]))
        lcm.guardians.clear()  # their "guardian" is this process: stop() would end it
        lcm.stop()


def changes_lcm(
    stores: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[LifecycleManager, JobsRepository, Counter[str], list[str]]:
    """`looking_lcm` with a look-back of LOOKBACK_S, whose change reads are counted per
    record (how often each record is returned)."""
    repo = own_repo(stores)
    lcm, looked = looking_lcm(stores, tmp_path, monkeypatch, repo, changes_lookback_s=LOOKBACK_S)
    returned: Counter[str] = Counter()
    read = repo.statuses_changed_since

    def counted(since: float, up_to: float | None = None) -> list[tuple[str, str]]:
        found = read(since, up_to)
        returned.update(job_id for job_id, _ in found)
        return found

    monkeypatch.setattr(repo, "statuses_changed_since", counted)
    return lcm, repo, returned, looked


LOOKBACK_S = 3.0


def test_new_submits_are_not_read_and_a_placement_is_read_about_twice(
    stores: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lcm, repo, returned, looked = changes_lcm(stores, tmp_path, monkeypatch)
    try:
        lcm.reconcile()  # the full round
        queued = [submit(repo, tmp_path, "true", place=False).job_id for _ in range(30)]
        for _ in range(5):
            lcm.reconcile()
        # A new record is QUEUED: nothing for the LCM to do, and not read (during a burst
        # of submits every round read each of them again for the whole look-back)
        assert not returned.keys() & set(queued)
        placed = queued[:10]
        for job_id in placed:
            repo.transition(job_id, states.PENDING, "placed")
        end = time.monotonic() + LOOKBACK_S + 2 * CHANGES_BAND_S
        while time.monotonic() < end:
            lcm.reconcile()
            time.sleep(0.2)  # rounds at least this far apart
        assert set(placed) <= set(looked)
        assert {j for j, s in lcm._active.items() if s == states.PENDING} == set(placed)
        # the fast reads from the round during its write to the first one that begins a
        # margin after it, and one band; reading the whole look-back each round (before),
        # LOOKBACK_S / 0.2 times
        most = int(CHANGES_MARGIN_S / 0.2) + 3
        assert max(returned[j] for j in placed) <= most
        assert not returned.keys() & set(queued[10:])
    finally:
        lcm.guardians.clear()
        lcm.stop()


def test_no_placed_job_is_missed_with_concurrent_and_late_writers(
    stores: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lcm, repo, _, looked = changes_lcm(stores, tmp_path, monkeypatch)

    def writer() -> None:
        for _ in range(8):
            submit(repo, tmp_path, "true")  # created, then placed: PENDING

    def late_writer() -> None:
        # A writer whose clock is behind (or whose writes land after their stamps) by
        # more than the margin, less than the look-back: its placements arrive after the
        # rounds' fast reads have passed their stamps.
        for _ in range(6):
            job = submit(repo, tmp_path, "true", place=False)
            placed_late(repo, job, time.time() - (CHANGES_MARGIN_S + LOOKBACK_S) / 2)
            time.sleep(0.15)

    lcm.reconcile()  # the full round
    # then change rounds: by the band after the last stamp's look-back, they have seen
    # every write
    write_while_reading(
        lcm.reconcile, [writer, writer, writer, late_writer], LOOKBACK_S + CHANGES_BAND_S + 0.5
    )
    try:
        pending = {str(d["_id"]) for d in repo._col.find({"status": states.PENDING}, {"_id": 1})}
        assert len(pending) == 3 * 8 + 6
        assert {j for j, s in lcm._active.items() if s == states.PENDING} == pending
        assert pending <= set(looked)
    finally:
        lcm.guardians.clear()
        lcm.stop()
