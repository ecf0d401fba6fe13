"""The LCM's rounds between its full ones are driven by changes (issue #18: a round over
every active job, five a second, was the daemon's largest steady cost per alive job):
they read the records written since the last round, not every active job's, and look
only at the jobs whose record or etcd keys changed, a job whose guardian exited, and
those something is counted in time for (no guardian yet). Every `full_round_s` a round
reads and looks at every active job again. Real etcd and MongoDB-wire server; the rounds
are called by the test, and `ensure_guardian` records instead of starting guardians."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from contract import etcd_keys, procs
from services.lcm.manager import LcmConfig, LifecycleManager, Supervised
from services.store import states
from services.store.jobs import JobsRepository
from services.store.mongo import connect
from tests.services.guardian.helpers import submit, wait_for
from tests.services.lcm.recording_repo import RecordingRepo

pytestmark = pytest.mark.integration


def test_rounds_between_full_ones_look_only_at_what_changed(
    stores: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A database of its own: a full round looks at every active job in it.
    repo = JobsRepository(connect(stores["mongo_url"], f"lcm_changes_{uuid.uuid4().hex[:8]}"))
    repo.ensure_indexes()
    recording = RecordingRepo(repo)
    config = LcmConfig(
        tmp_path,
        stores["etcd_url"],
        stores["mongo_url"],
        place_locally=False,
        guardians_per_host=0,
        full_round_s=3600.0,  # only the first round, and the test's, are full ones
    )
    lcm = LifecycleManager(config, recording, stores["etcd"])  # type: ignore[arg-type]
    me = procs.ProcRef.of(os.getpid())
    assert me is not None
    looked: list[str] = []

    def ensure_guardian(job_id: str, held: object, hostable: bool = False) -> None:
        # As a guardian process the LCM started: its exit would be the reaper's word.
        looked.append(job_id)
        lcm.guardians[job_id] = Supervised(job_id, me, child=True)

    monkeypatch.setattr(lcm, "ensure_guardian", ensure_guardian)

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
