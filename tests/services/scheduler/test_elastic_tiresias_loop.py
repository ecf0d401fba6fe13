"""Elastic-Tiresias in the daemon's scheduling loop (real etcd and MongoDB-wire server,
a real guardian process on the local backend): a queued gang that does not fit is
admitted by shrinking a running elastic job; the guardian's scaler applies the shrink
(its learner leaves), and only then does the scheduler free the resources and place the
waiting gang."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.guardian.elastic import request_scale
from services.scheduler.cluster import Cluster, Node
from services.scheduler.elasticity import get_scaling_policy
from services.scheduler.hosting import SchedulingLoop
from services.scheduler.requests import job_request
from services.scheduler.scheduler import GangScheduler
from services.scheduler.servicer import SchedulerServicer
from services.store import states
from tests.services.guardian.helpers import start_guardian, submit, wait_for

pytestmark = pytest.mark.integration

# every learner runs until the test creates <job dir>/stop
SCRIPT = "while [ ! -e ../stop ]; do sleep 0.1; done\n"


def test_a_queued_gang_is_admitted_by_shrinking_an_elastic_job(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    repo, etcd = stores["repo"], stores["etcd"]
    # one node with room for two 512 MiB learners
    cluster = Cluster([Node("local", cpus=8, memory_mb=1024)])
    # no queue threshold: any waiting job may make an elastic job outside queue 0 shrink;
    # quanta of 1 s put the running job in queue 1 at once
    policy = get_scaling_policy("elastic-tiresias", quanta_gpu_s=[1.0])
    scheduler = GangScheduler(cluster, scaling=policy)
    elastic = submit(repo, tmp_path, "sh run.sh", learners=2, files={"run.sh": SCRIPT},
                     elastic={"min": 1, "max": 2})  # fmt: skip
    scheduler.submit(job_request(elastic, arrival=0.0))
    assert [p.job_id for p in scheduler.schedule(now=0.0).placements] == [elastic.job_id]

    guardian = start_guardian(elastic.job_id, stores["etcd_url"], stores["mongo_url"], tmp_path)
    try:
        wait_for("PROCESSING", lambda: repo.get(elastic.job_id).status == states.PROCESSING)
        waiting = submit(repo, tmp_path, "true", learners=1, place=False)
        scheduler.submit(job_request(waiting))
        asked: list[tuple[str, int, str]] = []

        def scale(job_id: str, learners: int, reason: str) -> str:
            asked.append((job_id, learners, reason))
            return request_scale(etcd, repo, job_id, learners, reason)  # what the LCM does

        loop = SchedulingLoop(scheduler, SchedulerServicer(scheduler), repo, None, scale=scale)

        def shrink_asked() -> bool:
            loop._released_at = 0.0  # the release check (which reads the records) is due
            loop.run_pass()
            return bool(asked)

        # the first pass's release check reads the records: the job is elastic; then it shrinks
        wait_for("the shrink asked", shrink_asked, timeout_s=10)
        assert [(j, n) for j, n, _ in asked] == [(elastic.job_id, 1)]
        assert "Elastic-Tiresias" in asked[0][2]
        # asked, not yet done: the resources stay held, the gang waits and says why
        assert repo.get(waiting.job_id).status == states.QUEUED
        assert "to shrink" in scheduler.explain(waiting.job_id)

        def placed() -> bool:
            loop.run_pass()
            return repo.get(waiting.job_id).status == states.PENDING

        wait_for("the waiting gang placed", placed, timeout_s=90)
        record = repo.get(elastic.job_id)
        assert int(record.resources["learners"]) == 1  # the guardian applied the shrink
        assert any("scaled 2 → 1 learners" in h.message for h in record.history)
        assert scheduler.job_size(elastic.job_id) == 1
        assert len(asked) == 1  # one shrink asked for one waiting job
    finally:
        (tmp_path / "jobs" / elastic.job_id / "stop").touch()
        guardian.terminate()
        guardian.wait(timeout=30)
