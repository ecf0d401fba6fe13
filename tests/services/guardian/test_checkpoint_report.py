"""The guardian reports a job's newest committed checkpoint to its record, and the
scheduling loop hands it to the scheduler for its choice of preemption victims (real etcd
and MongoDB-wire server, a real guardian on the local backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.scheduler.cluster import Cluster, Node
from services.scheduler.hosting import SchedulingLoop
from services.scheduler.requests import job_request
from services.scheduler.scheduler import GangScheduler
from services.scheduler.servicer import SchedulerServicer
from tests.services.guardian.helpers import start_guardian, submit, wait_for

pytestmark = pytest.mark.integration

# a checkpoint committed as the SDK lays it out (tests/contract/test_checkpoints.py
# checks that layout against the SDK), then run until the test creates <job dir>/stop
SCRIPT = """d="$RHIZOME_CHECKPOINT_DIR/ckpt-00000003-periodic-s7"
mkdir -p "$d" && echo 1234.5 > "$d/COMMITTED"
while [ ! -e ../stop ]; do sleep 0.1; done
"""


def test_the_last_checkpoint_reaches_the_record_and_the_scheduler(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    repo = stores["repo"]
    job = submit(repo, tmp_path, "sh run.sh", learners=1, files={"run.sh": SCRIPT})
    guardian = start_guardian(job.job_id, stores["etcd_url"], stores["mongo_url"], tmp_path)
    try:

        def reported() -> dict[str, Any] | None:
            return (repo.get(job.job_id).placement or {}).get("last_checkpoint")

        assert wait_for("the checkpoint reported", reported, timeout_s=60) == {
            "at": 1234.5,
            "step": 7,
        }
        scheduler = GangScheduler(Cluster([Node("local", cpus=8, memory_mb=4096)]))
        scheduler.submit(job_request(job))
        scheduler.schedule(now=0.0)
        loop = SchedulingLoop(scheduler, SchedulerServicer(scheduler), repo, None)
        loop.run_pass()  # its release check reads the record
        assert scheduler.elasticity.checkpoints[job.job_id] == 1234.5
    finally:
        (tmp_path / "jobs" / job.job_id / "stop").touch()
        guardian.terminate()
        guardian.wait(timeout=30)
