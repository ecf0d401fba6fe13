"""One function turns a stored job into a scheduler request; the API's Admit is its
proto form, and the manifest's defaults come from the schema."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.manifest import parse_manifest, schema, schema_default
from services.scheduler.api import InvalidJobRequest, JobRequest
from services.scheduler.requests import (
    admit_request,
    job_request,
    request_from_proto,
    request_to_proto,
)
from services.store.jobs import JobRecord


def stored(**fields: Any) -> JobRecord:
    """A job record as the API stores it."""
    manifest = parse_manifest(
        json.dumps({"name": "j", "framework": {"command": "python t.py"}, **fields})
    )
    return JobRecord.for_manifest("job-1", "alice", manifest, created_at=123.0)


def test_the_defaults_come_from_the_schema() -> None:
    req = job_request(stored())
    props = schema()["properties"]
    assert req.priority == props["priority"]["default"] == 50
    assert req.learners == props["learners"]["default"]
    assert req.gpus == props["gpus"]["default"]
    assert req.cpus == props["cpus"]["default"]
    assert req.memory_mb == 1024.0  # "1Gb", the schema's memory default
    assert req.zone_aware is False
    assert req == JobRequest(
        job_id="job-1",
        learners=1,
        gpus=0,
        cpus=1.0,
        memory_mb=1024.0,
        owner="alice",
        priority=50,
        arrival=123.0,
    )
    assert stored().spec.max_learner_restarts == schema_default("max_learner_restarts")


def test_a_field_without_a_schema_default_is_named() -> None:
    with pytest.raises(KeyError, match="gpu_type"):
        schema_default("gpu_type")


def test_the_manifest_is_honoured() -> None:
    req = job_request(
        stored(priority=80, learners=2, gpus=1, gpu_type="v100", cpus=4, memory="2GiB")
    )
    assert (req.priority, req.learners, req.gpus, req.gpu_type) == (80, 2, 1, "v100")
    assert (req.cpus, req.memory_mb) == (4.0, 2048.0)


@pytest.mark.parametrize(
    ("pipeline", "zone_aware"),
    [
        ({"stages": 1}, False),
        ({"stages": 1, "pipelines": 3}, False),
        ({"stages": 2}, True),
        ({"stages": 4, "pipelines": 2}, True),
    ],
)
def test_pipelines_of_more_than_one_stage_are_zone_aware(
    pipeline: dict[str, int], zone_aware: bool
) -> None:
    req = job_request(stored(pipeline=pipeline))
    assert req.zone_aware is zone_aware
    assert req.learners == pipeline["stages"] * pipeline.get("pipelines", 1)


def test_the_admit_proto_carries_the_same_request() -> None:
    job = stored(priority=7, learners=4, gpus=2, gpu_type="a100", pipeline={"stages": 4})
    proto = admit_request(job, check_only=True)
    assert proto.check_only and proto.job_id == "job-1" and proto.owner == "alice"
    # What the scheduler reads back is what the resync would enqueue (it stamps arrival).
    assert request_from_proto(proto, arrival=5.0) == job_request(job, arrival=5.0)
    assert not request_to_proto(job_request(job)).check_only


def test_fractional_gpus_are_refused_with_the_reason() -> None:
    with pytest.raises(InvalidJobRequest, match="fractional GPUs"):
        job_request(stored(gpus=0.5, gpu_type="v100"))
