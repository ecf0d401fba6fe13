"""A job halted to give borrowed quota back says in its history who needed it and why
(the daemon's scheduling loop, real MongoDB-wire server)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.manifest import parse_manifest
from services.scheduler.hosting import SchedulingLoop
from services.scheduler.quota import quota_config_from_mapping
from services.scheduler.requests import job_request
from services.scheduler.scheduler import GangScheduler
from services.scheduler.servicer import SchedulerServicer
from services.store import states
from services.store.jobs import JobRecord, JobsRepository, new_job_id
from tests.services.scheduler.conftest import gpu_cluster

pytestmark = pytest.mark.integration


def stored(repo: JobsRepository, owner: str) -> JobRecord:
    manifest = parse_manifest(
        json.dumps({"name": owner, "learners": 4, "gpus": 1, "gpu_type": "V100",
                    "framework": {"command": "true"}})
    )  # fmt: skip
    job_id = new_job_id()
    repo.create(JobRecord.for_manifest(job_id, owner, manifest))
    return repo.get(job_id)


def test_the_halted_borrower_is_told_whose_job_needed_the_gpus(stores: dict[str, Any]) -> None:
    repo = stores["repo"]
    quotas = quota_config_from_mapping({"users": {"alice": {"quota": {"V100": 4}}}}, ["V100"])
    scheduler = GangScheduler(gpu_cluster(nodes=1, gpus=4), quotas=quotas)
    loop = SchedulingLoop(scheduler, SchedulerServicer(scheduler), repo, None)
    bob = stored(repo, "bob")
    scheduler.submit(job_request(bob))
    loop.run_pass()
    assert repo.get(bob.job_id).status == states.PENDING  # borrowing alice's idle GPUs
    alice = stored(repo, "alice")
    scheduler.submit(job_request(alice))
    loop.run_pass()
    halted = repo.get(bob.job_id)
    assert halted.status == states.HALTED
    assert f"alice of the quota it borrowed needs it back for job {alice.job_id}" in (
        halted.history[-1].message
    )
    assert repo.get(alice.job_id).status == states.PENDING
