"""The newest checkpoint a job's learners reported (stored on its record by the TDS,
contract/checkpoints.py) reaches the scheduler through the scheduling loop, for its
choice of the preemption victim that loses the least work (real MongoDB-wire server)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from contract.checkpoints import CheckpointReport
from services.scheduler.cluster import Cluster, Node
from services.scheduler.hosting import SchedulingLoop
from services.scheduler.requests import job_request
from services.scheduler.scheduler import GangScheduler
from services.scheduler.servicer import SchedulerServicer
from tests.services.guardian.helpers import submit

pytestmark = pytest.mark.integration


def test_the_newest_reported_checkpoint_reaches_the_scheduler(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    repo = stores["repo"]
    job = submit(repo, tmp_path, "true", learners=1)
    reports = [
        CheckpointReport(kind="insurance", step=7, size_bytes=10, time=1234.5),
        CheckpointReport(kind="periodic", step=3, size_bytes=10, time=1000.0),
    ]
    assert repo.add_checkpoints(job.job_id, [asdict(r) for r in reports])
    assert repo.get(job.job_id).last_checkpoint == {"at": 1234.5, "step": 7}
    scheduler = GangScheduler(Cluster([Node("local", cpus=8, memory_mb=4096)]))
    scheduler.submit(job_request(job))
    scheduler.schedule(now=0.0)
    loop = SchedulingLoop(scheduler, SchedulerServicer(scheduler), repo, None)
    loop.run_pass()  # its release check reads the record
    assert scheduler.elasticity.checkpoints[job.job_id] == 1234.5
