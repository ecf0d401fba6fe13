"""An elastic worker that left as a straggler is reported by its guardian (the learner's
node in the record's `placement.stragglers`, a line in the history), and the scheduling
loop makes the scheduler avoid that node (real etcd and MongoDB-wire server, a real
guardian on the local backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from contract import etcd_keys
from services.scheduler.cluster import Cluster, Node
from services.scheduler.hosting import SchedulingLoop
from services.scheduler.scheduler import GangScheduler
from services.scheduler.servicer import SchedulerServicer
from services.store import states
from tests.services.guardian.helpers import start_guardian, submit, wait_for

pytestmark = pytest.mark.integration

SCRIPT = "while [ ! -e ../stop ]; do sleep 0.1; done\n"


def test_a_straggler_is_reported_and_its_node_avoided(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    repo, etcd = stores["repo"], stores["etcd"]
    job = submit(repo, tmp_path, "sh run.sh", learners=2, files={"run.sh": SCRIPT},
                 elastic={"min": 1, "max": 2})  # fmt: skip
    guardian = start_guardian(job.job_id, stores["etcd_url"], stores["mongo_url"], tmp_path)
    try:
        wait_for("PROCESSING", lambda: repo.get(job.job_id).status == states.PROCESSING)
        # what the learner library writes when learner 1's worker leaves as a straggler
        reason = "straggler: 3.2x the median step time for 10 mini-batches"
        etcd.put(etcd_keys.elastic_leave(job.job_id, "learner1-ab12"), {"reason": reason,
                                                                         "step": 40})  # fmt: skip
        # a graceful leave is not a straggler
        etcd.put(etcd_keys.elastic_leave(job.job_id, "learner0-cd34"), {"reason": "SIGTERM"})

        def reported() -> list[dict[str, Any]] | None:
            return (repo.get(job.job_id).placement or {}).get("stragglers")

        stragglers = wait_for("the straggler reported", reported, timeout_s=30)
        assert [(s["node"], s["rank"], s["reason"]) for s in stragglers] == [("local", 1, reason)]
        wait_for(
            "the history line",
            lambda: any(
                "learner 1 on local left as a straggler" in h.message
                for h in repo.get(job.job_id).history
            ),
        )
        cluster = Cluster([Node("local", cpus=8, memory_mb=4096), Node("other", 8, 4096)])
        scheduler = GangScheduler(cluster)
        loop = SchedulingLoop(scheduler, SchedulerServicer(scheduler), repo, None)
        loop._follow_records([repo.get(job.job_id)])
        assert list(scheduler.avoided) == ["local"]
    finally:
        (tmp_path / "jobs" / job.job_id / "stop").touch()
        guardian.terminate()
        guardian.wait(timeout=30)
