"""Every field the manifest schema accepts reaches the code that honours it.

The schema is walked; each field must be named below with where it is honoured (a file
and what that file reads), or be one of the few fields that are only shown back to the
user (FfDL's descriptive fields). A field added to the schema without a reader fails this
test, and so does a reader that stops reading its field.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.manifest import schema

REPO = Path(__file__).resolve().parents[3]

# field -> [(file, what it reads)]: every pair must hold.
READERS: dict[str, list[tuple[str, str]]] = {
    "name": [("services/store/jobs.py", "name=manifest.name")],
    "description": [("services/store/jobs.py", "description=manifest.description")],
    # Resources are stored with the job (TrainerCore) and read by the scheduler and guardian.
    "learners": [("services/scheduler/requests.py", 'res["learners"]')],
    "gpus": [("services/scheduler/requests.py", 'res["gpus"]')],
    "cpus": [("services/scheduler/requests.py", 'res["cpus"]')],
    "memory": [("services/scheduler/requests.py", 'res["memory_mb"]')],
    "gpu_type": [("services/scheduler/requests.py", 'res["gpu_type"]')],
    "priority": [("services/scheduler/requests.py", "spec.priority")],
    "max_learner_restarts": [("services/guardian/guardian.py", "spec.max_learner_restarts")],
    "max_preemptions": [("services/guardian/guardian.py", "manifest.max_preemptions")],
    "env": [("services/backends/local/backend.py", "job.manifest.env")],
    "data_stores.id": [("services/backends/local/backend.py", "ds.id")],
    "data_stores.type": [("services/backends/local/backend.py", "ds.type")],
    "data_stores.connection": [
        ("services/backends/local/backend.py", "store.connection"),
        ("services/backends/local/backend.py", 'ds.connection.get("path")'),
    ],
    "data_stores.training_data.container": [
        ("services/backends/local/backend.py", "ds.training_data")
    ],
    "data_stores.training_results.container": [
        ("services/backends/local/backend.py", "ds.training_results"),
        ("learner/controller/controller.py", '"results_path"'),
    ],
    "framework.command": [("services/guardian/guardian.py", "manifest.command")],
    "evaluation_metrics": [
        # with a pipeline job's runtime metrics added (contract/runtime_metrics.py)
        ("services/manifest/types.py", "sources = self.evaluation_metrics"),
        ("services/backends/local/backend.py", "manifest.metric_sources"),
        ("learner/controller/collector.py", "metric_sources"),
    ],
    "pipeline.stages": [
        ("services/scheduler/requests.py", "spec.pipeline.stages"),
        ("services/backends/local/backend.py", "pipe.stages"),
        ("learner/controller/controller.py", "PIPELINE_STAGES"),
        ("contract/env.py", "stages=env.pipeline_stages"),
        ("contract/env.py", "env.pipeline_stages"),
    ],
    "pipeline.pipelines": [
        ("services/backends/local/backend.py", "pipe.pipelines"),
        ("contract/env.py", "pipelines=env.pipeline_pipelines"),
        ("contract/env.py", "env.pipeline_pipelines"),
    ],
    "pipeline.redundancy": [
        ("services/backends/local/backend.py", "pipe.redundancy"),
        ("contract/env.py", "redundancy=env.pipeline_redundancy"),
        ("contract/env.py", "env.pipeline_redundancy"),
        ("learner/runtime/worker.py", "env.redundancy"),
    ],
    "pipeline.standbys": [
        ("services/manifest/types.py", "self.workers + self.standbys"),
        ("services/guardian/pipeline.py", "pipe.standbys"),
    ],
    "pipeline.max_pipelines": [
        ("services/manifest/types.py", 'pipe.get("max_pipelines")'),
        ("services/guardian/pipeline.py", "pipe.max_pipelines"),
    ],
    "pipeline.microbatches": [
        ("services/backends/local/backend.py", "pipe.microbatches"),
        ("contract/env.py", "microbatches=env.pipeline_microbatches"),
        ("contract/env.py", "env.pipeline_microbatches"),
        ("learner/runtime/worker.py", "env.microbatches"),
    ],
    "pipeline.metrics_every": [
        ("services/backends/local/backend.py", "pipe.metrics_every"),
        ("contract/env.py", "metrics_every=env.pipeline_metrics_every"),
        ("learner/runtime/worker.py", "env.metrics_every"),
        ("learner/runtime/engine.py", "opts.metrics_every"),
    ],
    "checkpoint.policy": [
        ("services/backends/local/backend.py", "ck.policy"),
        ("learner/checkpoint/manager.py", "checkpoint_policy"),
    ],
    "checkpoint.interval_s": [
        ("services/backends/local/backend.py", "ck.interval_s"),
        ("learner/checkpoint/manager.py", "checkpoint_interval_s"),
    ],
    "checkpoint.grace_s": [
        ("services/guardian/guardian.py", "manifest.checkpoint.grace_s"),
        ("services/backends/local/backend.py", "job.grace_s"),
    ],
    "checkpoint.keep": [
        ("services/backends/local/backend.py", "ck.keep"),
        ("learner/checkpoint/manager.py", "keep_periodic=env.keep"),
    ],
    "elastic.min": [("services/api/core.py", "elastic.min")],
    "elastic.max": [("services/api/core.py", "elastic.max")],
    "framework.image": [("services/backends/docker/backend.py", "framework.image")],
    "instance_type": [("services/guardian/guardian.py", "manifest.instance_type")],
    "zones": [("services/guardian/guardian.py", "manifest.zones")],
    # `rhizome estimate` alone reads the estimate section (services/sim/cli.py).
    **{
        f"estimate.{key}": [("services/sim/cli.py", f'"{key}"')]
        for key in (
            "steps",
            "step_time",
            "save_time",
            "backup_time",
            "alloc_time",
            "prep_time",
            "samples_per_step",
            "notice",
            "prices",
        )
    },
}

# FfDL's descriptive fields: no code acts on them; the API shows them back (checked below).
SHOWN_ONLY = {"version": "1.0", "framework.name": "tensorflow", "framework.version": "1.5"}


def _fields(node: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted paths of the schema's fields; a field whose value is an object with its own
    properties is walked into, anything else is one field."""
    for name, sub in node.get("properties", {}).items():
        path = f"{prefix}{name}"
        if sub.get("type") == "array" and "properties" in sub.get("items", {}):
            sub = sub["items"]
        if "properties" in sub:
            yield from _fields(sub, f"{path}.")
        else:
            yield path


def test_every_schema_field_has_a_reader_or_is_shown_only() -> None:
    fields = set(_fields(schema()))
    unread = sorted(fields - set(READERS) - set(SHOWN_ONLY))
    assert not unread, f"schema fields no code reads (wire them or remove them): {unread}"
    stale = sorted((set(READERS) | set(SHOWN_ONLY)) - fields)
    assert not stale, f"readers named for fields the schema no longer has: {stale}"


@pytest.mark.parametrize("field", sorted(READERS))
def test_the_named_reader_still_reads_its_field(field: str) -> None:
    for file, what in READERS[field]:
        text = (REPO / file).read_text(encoding="utf-8")
        assert what in text, f"{field}: {file} no longer reads {what!r}"


def test_shown_only_fields_are_shown_back_by_the_api() -> None:
    from google.protobuf import json_format

    from services.api.convert import job_to_proto
    from services.manifest import parse_manifest
    from services.store.jobs import JobRecord

    parsed = parse_manifest(
        "name: a\nversion: '1.0'\nframework: {name: tensorflow, version: '1.5', command: x}\n"
    )
    record = JobRecord.for_manifest("job-1", "u", parsed)
    shown = json_format.MessageToDict(job_to_proto(record))["manifest"]
    for path, value in SHOWN_ONLY.items():
        node: Any = shown
        for part in path.split("."):
            node = node[part]
        assert node == value, path
