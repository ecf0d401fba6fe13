"""A running elastic job's scale-out is a gang of its own in the daemon's scheduling loop
(real MongoDB-wire server for the job records): it is placed and answered without a job
record of its own to move, it holds its resources while its job lists it, and it is
released once the job stops listing it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.manifest import parse_manifest
from services.scheduler.api import JobRequest, scale_gang_id, scale_gang_parent
from services.scheduler.hosting import SchedulingLoop
from services.scheduler.scheduler import GangScheduler
from services.scheduler.servicer import SchedulerServicer
from services.store import states
from services.store.jobs import JobRecord, new_job_id
from tests.services.scheduler.conftest import gpu_cluster

pytestmark = pytest.mark.integration


def test_a_gang_id_names_its_job() -> None:
    assert scale_gang_parent(scale_gang_id("job-1", 7)) == "job-1"
    assert scale_gang_parent("job-1") is None


def test_a_scale_gang_is_placed_held_while_listed_and_released_after(
    stores: dict[str, Any],
) -> None:
    repo = stores["repo"]
    manifest = parse_manifest(
        json.dumps(
            {"name": "e", "learners": 1, "gpus": 1, "gpu_type": "V100", "elastic": {"min": 1, "max": 3},
             "framework": {"command": "true"}}
        )
    )  # fmt: skip
    job_id = new_job_id()
    repo.create(JobRecord.for_manifest(job_id, "alice", manifest))
    placement = {"learner_nodes": {"0": "n0"}, "placed_at": 0}
    repo.transition(job_id, states.PENDING, "placed", placement=placement)
    for status in (states.DEPLOYING, states.PROCESSING):
        repo.transition(job_id, status, status.lower())
    gang = scale_gang_id(job_id, 1)
    repo.update_fields(job_id, **{f"placement.scale_gangs.{gang}": {"state": "requested"}})

    scheduler = GangScheduler(gpu_cluster(nodes=1, gpus=2))
    loop = SchedulingLoop(scheduler, SchedulerServicer(scheduler), repo, lcm_channel=None)
    scheduler.enqueue(JobRequest(job_id=gang, learners=2, gpus=1, gpu_type="V100", owner="alice"))
    loop.run_pass()
    assert gang in loop.gangs  # what Schedule answers the API with
    assert list(loop.gangs[gang].placement.learner_nodes.values()) == ["n0", "n0"]
    record = repo.get(job_id)
    assert record.status == states.PROCESSING  # the job's own record did not move
    assert scheduler.cluster_view().nodes[0].gpus_free == 0  # the gang holds its GPUs

    loop._released_at = 0.0  # the release check is due
    loop.run_pass()
    assert scheduler.placement(gang) is not None  # still listed: still held

    repo.update_fields(job_id, **{f"placement.scale_gangs.{gang}": None})  # retired
    loop._released_at = 0.0
    loop.run_pass()
    assert gang not in scheduler.records and gang not in loop.gangs
    assert scheduler.cluster_view().nodes[0].gpus_free == 2
