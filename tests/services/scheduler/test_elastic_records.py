"""The scheduling loop follows an elastic job's size from its record (real MongoDB-wire
server): a scale-in frees what the retired learners held, the job's own gang included,
while a scale-out in flight (its gang placed, the record not yet grown) keeps its gang;
a growth proposed by Elastic-Tiresias is a scale gang listed in the record and placed
before the resize is asked (the LCM call is recorded here, not made)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.manifest import parse_manifest
from services.scheduler.api import JobRequest, scale_gang_id
from services.scheduler.elasticity import get_scaling_policy
from services.scheduler.hosting import SchedulingLoop
from services.scheduler.scheduler import GangScheduler
from services.scheduler.servicer import SchedulerServicer
from services.store import states
from services.store.jobs import JobRecord, JobsRepository, new_job_id
from tests.services.scheduler.conftest import gpu_cluster

pytestmark = pytest.mark.integration


def running_elastic(repo: JobsRepository, learners: int) -> str:
    manifest = parse_manifest(
        json.dumps(
            {"name": "e", "learners": learners, "gpus": 1, "gpu_type": "V100",
             "elastic": {"min": 1, "max": 4}, "framework": {"command": "true"}}
        )
    )  # fmt: skip
    job_id = new_job_id()
    repo.create(JobRecord.for_manifest(job_id, "alice", manifest))
    nodes = {str(r): "n0" for r in range(learners)}
    repo.transition(job_id, states.PENDING, "placed", placement={"learner_nodes": nodes})
    for status in (states.DEPLOYING, states.PROCESSING):
        repo.transition(job_id, status, status.lower())
    return job_id


def loop_over(
    repo: JobsRepository, job_id: str, learners: int
) -> tuple[GangScheduler, SchedulingLoop]:
    scheduler = GangScheduler(gpu_cluster(nodes=1, gpus=4))
    request = JobRequest(job_id, learners=learners, gpus=1, gpu_type="V100", owner="alice")
    scheduler.submit(request)
    scheduler.schedule(now=0)
    return scheduler, SchedulingLoop(scheduler, SchedulerServicer(scheduler), repo, None)


def test_a_scale_in_frees_what_the_retired_learners_held(stores: dict[str, Any]) -> None:
    repo = stores["repo"]
    job_id = running_elastic(repo, 2)
    scheduler, loop = loop_over(repo, job_id, 2)
    repo.update_fields(job_id, **{"resources.learners": 1})  # the guardian retired rank 1
    loop.run_pass()
    assert scheduler.job_size(job_id) == 1
    assert scheduler.cluster.free_gpus() == 3


def test_a_scale_out_in_flight_keeps_its_gang(stores: dict[str, Any]) -> None:
    repo = stores["repo"]
    job_id = running_elastic(repo, 1)
    scheduler, loop = loop_over(repo, job_id, 1)
    gang = scale_gang_id(job_id, 2)
    entry = {"learners": 2, "target": 3, "state": "requested", "nodes": ["n0", "n0"]}
    repo.update_fields(job_id, **{f"placement.scale_gangs.{gang}": entry})
    scheduler.submit(JobRequest(gang, learners=2, gpus=1, gpu_type="V100", owner="alice"))
    scheduler.schedule(now=1)
    loop.run_pass()  # the record still says 1 learner: the added two are starting
    assert scheduler.job_size(job_id) == 3
    assert scheduler.cluster.free_gpus() == 1


def test_a_growth_is_a_scale_gang_placed_and_listed_before_the_resize_is_asked(
    stores: dict[str, Any],
) -> None:
    repo = stores["repo"]
    job_id = running_elastic(repo, 1)
    scheduler = GangScheduler(
        gpu_cluster(nodes=1, gpus=4), scaling=get_scaling_policy("elastic-tiresias")
    )
    scheduler.submit(JobRequest(job_id, learners=1, gpus=1, gpu_type="V100", owner="alice"))
    scheduler.schedule(now=0)
    asked: list[tuple[str, int]] = []

    def scale(job: str, learners: int, reason: str) -> str:
        # what the LCM's ScaleJob is given (the guardian's side: tests/services/guardian)
        record = repo.get(job)
        gangs = (record.placement or {}).get("scale_gangs") or {}
        assert [g["state"] for g in gangs.values()] == ["requested"]  # listed first
        asked.append((job, learners))
        return "ok"

    loop = SchedulingLoop(scheduler, SchedulerServicer(scheduler), repo, None, scale=scale)
    loop.run_pass()  # the release check reads the record: the job is elastic (max 4)
    loop.run_pass()  # nothing waits: it grows into the 3 idle GPUs
    assert asked == [(job_id, 4)]
    gangs = repo.get(job_id).placement["scale_gangs"]
    (entry,) = gangs.values()
    assert entry["learners"] == 3 and entry["nodes"] == ["n0", "n0", "n0"]
    assert scheduler.job_size(job_id) == 4 and scheduler.cluster.free_gpus() == 0
