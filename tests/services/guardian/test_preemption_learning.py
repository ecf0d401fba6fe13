"""The guardian teaches the platform about preemptions: a learner killed by a signal is
recorded as a preemption of its instance type and zone, its restart as a reallocation,
and every learner gets the current estimates in RHIZOME_MTTP_S / RHIZOME_RESTART_S."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from services.store import states
from services.store.mongo import connect
from services.store.preemption_stats import PreemptionStatsRepository
from tests.services.guardian.helpers import start_guardian, submit, wait_for

pytestmark = pytest.mark.integration

# The first attempt prints what the platform told it, then dies of SIGKILL as a
# preempted node's learner would; the restarted one prints again and succeeds.
SCRIPT = """echo "mttp=$RHIZOME_MTTP_S restart=$RHIZOME_RESTART_S"
if [ ! -e ../preempted ]; then touch ../preempted; sleep 0.3; kill -9 $$; fi
echo done
"""


def run_guardian(stores: dict[str, Any], tmp_path: Path, job_id: str) -> int:
    guardian = start_guardian(job_id, stores["etcd_url"], stores["mongo_url"], tmp_path)
    try:
        return guardian.wait(timeout=90)
    finally:
        if guardian.poll() is None:
            guardian.kill()
            guardian.wait()


def test_a_sigkilled_learner_is_learned_as_a_preemption_and_its_restart_as_a_reallocation(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    # An instance type of its own: the estimates start at the configured prior.
    itype, zone = f"it-{uuid.uuid4().hex[:6]}", "zone-a"
    stats = PreemptionStatsRepository(connect(stores["mongo_url"]))
    stats.ensure_indexes()
    job = submit(
        stores["repo"], tmp_path, "sh run.sh", files={"run.sh": SCRIPT},
        instance_type=itype, zones=[zone], max_learner_restarts=2,
    )  # fmt: skip
    assert run_guardian(stores, tmp_path, job.job_id) == 0
    assert stores["repo"].get(job.job_id).status == states.COMPLETED
    out = (tmp_path / "jobs" / job.job_id / "learners" / "0" / "stdout.log").read_text()
    # Both attempts got the platform's estimates (the prior until there is data).
    assert out.count("mttp=3600.000 restart=300.000") == 2, out
    records = list(stats._col.find({"instance_type": itype}))
    kinds = sorted(r["kind"] for r in records)
    assert kinds == ["preemption", "reallocation"]
    preemption = next(r for r in records if r["kind"] == "preemption")
    assert preemption["job_id"] == job.job_id
    assert 0 < preemption["lifetime_s"] < 60
    reallocation = next(r for r in records if r["kind"] == "reallocation")
    assert 0 < reallocation["wait_s"] < 60


def test_a_learner_that_fails_by_itself_is_not_a_preemption(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    itype = f"it-{uuid.uuid4().hex[:6]}"
    stats = PreemptionStatsRepository(connect(stores["mongo_url"]))
    job = submit(
        stores["repo"], tmp_path, "sh run.sh", files={"run.sh": "exit 7\n"},
        instance_type=itype, zones=["zone-a"], max_learner_restarts=1,
    )  # fmt: skip
    assert run_guardian(stores, tmp_path, job.job_id) == 0
    wait_for("FAILED", lambda: stores["repo"].get(job.job_id).status == states.FAILED)
    assert list(stats._col.find({"instance_type": itype})) == []
