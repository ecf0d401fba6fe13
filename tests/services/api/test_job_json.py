"""The REST gateway's job JSON (`convert.job_json`, built straight from the record) is,
byte for byte, what the proto's generic JSON walk gives
(`MessageToDict(job_to_proto(job), preserving_proto_field_name=True)`), which the gateway
answered before (issue #18). One difference is allowed: the order of a manifest's keys,
which the walk takes from the Struct's hash order (it changes from one process to the
next) and `job_json` from the record."""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st

from services.api.convert import job_json, job_to_proto
from services.manifest import parse_manifest
from services.store import states
from services.store.jobs import JobRecord, StatusEntry

PLAIN = "name: plain\nframework:\n  command: python train.py\n"
FULL = """
name: digits CNN run
description: "digits CNN — ünïcode"
version: "1.0"
learners: 2
gpus: 0.5
cpus: 1.5
memory: 1Gb
gpu_type: V100
priority: 50
env: {BATCH_SIZE: 64, EMPTY: ""}
framework:
  name: pytorch
  version: "2.13"
  command: python train.py --lr 0.001
data_stores:
  - id: store1
    type: local
    training_data: {container: data}
    training_results: {container: results}
evaluation_metrics:
  type: logger
checkpoint: {policy: fixed, interval_s: 600, grace_s: 30, keep: 2}
elastic: {min: 1, max: 8}
zones: [us-east-1a, us-east-1b]
"""
PIPELINE = """
name: pipe
framework: {command: python gpt.py}
pipeline: {stages: 4, pipelines: 2, microbatches: 8, standbys: 1}
"""


def reference(job: JobRecord) -> dict[str, Any]:
    body: dict[str, Any] = json_format.MessageToDict(
        job_to_proto(job), preserving_proto_field_name=True
    )
    return body


def in_order_of(value: Any, like: Any) -> Any:
    """`value` with its mappings' keys in the order of `like`'s (the same keys)."""
    if isinstance(value, dict):
        assert isinstance(like, dict) and set(value) == set(like)
        return {k: in_order_of(value[k], like[k]) for k in like}
    if isinstance(value, list):
        assert isinstance(like, list) and len(value) == len(like)
        return [in_order_of(v, w) for v, w in zip(value, like, strict=True)]
    return value


def assert_same_json(job: JobRecord) -> None:
    ours, walked = job_json(job), reference(job)
    if "manifest" in walked:
        walked["manifest"] = in_order_of(walked["manifest"], ours.get("manifest"))
    # as the gateway sends it (JSONResponse) and as the walk's own json.dumps would
    for dump in (
        lambda d: json.dumps(d, ensure_ascii=False, separators=(",", ":")),
        json.dumps,
    ):
        assert dump(ours) == dump(walked)


def record(manifest: str, **fields: Any) -> JobRecord:
    job = JobRecord.for_manifest("job-0123", "alice", parse_manifest(manifest))
    for name, value in fields.items():
        setattr(job, name, value)
    return job


def test_a_job_just_submitted_is_the_same_json() -> None:
    for manifest in (PLAIN, FULL, PIPELINE):
        job = record(
            manifest,
            created_at=1795859387.123456,
            updated_at=1795859387.123456,
            history=[StatusEntry(states.QUEUED, 1795859387.123456, "submitted")],
        )
        assert_same_json(job)
    assert_same_json(record(PLAIN, idempotency_key="k-1"))  # at the epoch, no history


def test_a_job_that_ran_is_the_same_json() -> None:
    job = record(
        FULL,
        status=states.FAILED,
        status_message="learner 1 exited with 3",
        history=[
            StatusEntry(states.QUEUED, 1795859387.0, "submitted"),
            StatusEntry(states.PENDING, 1795859388.5, ""),
            StatusEntry(states.PROCESSING, 1795859390.000001, "running"),
            StatusEntry(states.FAILED, 1795859399.987654321, "learner 1 exited with 3"),
        ],
        created_at=1795859387.0,
        updated_at=1795859399.25,
        placement={
            "learner_nodes": {str(r): f"node-{r % 3}" for r in range(12)},
            "placed_at": 1795859388.5,
            "stragglers": [],
        },
        attempts=2,
        queue_reason="waiting",
        exit_code=-9,
        last_log_lines=["epoch 1", "", "ünïcode ✓"],
        last_metrics=[
            {"name": "loss", "value": 0.25, "step": 10, "time": 1795859391.5, "learner": 1},
            {"name": "acc", "value": 0.0, "step": 0, "time": 0.0, "learner": 0},
            {"name": "neg", "value": -0.0, "step": -1, "time": 0.5, "learner": 0},  # kept
            {"name": "big", "value": -1e300, "step": 2**62, "time": 1.0, "learner": 0},
        ],
        checkpoints=[
            {
                "kind": "periodic",
                "step": 100,
                "size_bytes": 2**40,
                "time": 1795859392.0,
                "learner": "0",
                "name": "ckpt-100",
            },
            {"kind": "", "step": 0, "size_bytes": 0, "time": 0.0, "learner": "", "name": ""},
        ],
    )
    assert_same_json(job)


times = st.floats(min_value=0, max_value=4e9, allow_nan=False)
doubles = st.floats(allow_nan=False, allow_infinity=False)


@settings(max_examples=150, deadline=None)
@given(
    created=times,
    history=st.lists(
        st.tuples(st.sampled_from(sorted(states.ALL_STATES)), times, st.text(max_size=8)),
        max_size=4,
    ),
    nodes=st.dictionaries(st.integers(0, 300), st.text(max_size=6), max_size=40),
    placed=st.booleans(),
    numbers=st.tuples(st.integers(-(2**31), 2**31 - 1), st.integers(-(2**31), 2**31 - 1)),
    metrics=st.lists(
        st.tuples(st.text(max_size=5), doubles, st.integers(-(2**63), 2**63 - 1), times),
        max_size=3,
    ),
    lines=st.lists(st.text(max_size=10), max_size=3),
)
def test_any_record_is_the_same_json(
    created: float,
    history: list[tuple[str, float, str]],
    nodes: dict[int, str],
    placed: bool,
    numbers: tuple[int, int],
    metrics: list[tuple[str, float, int, float]],
    lines: list[str],
) -> None:
    job = record(
        FULL,
        created_at=created,
        updated_at=created + 0.5,
        history=[StatusEntry(s, t, m) for s, t, m in history],
        placement={"learner_nodes": {str(k): v for k, v in nodes.items()}, "placed_at": created}
        if placed
        else None,
        attempts=numbers[0],
        exit_code=numbers[1],
        last_log_lines=lines,
        last_metrics=[
            {"name": n, "value": v, "step": s, "time": t, "learner": 1} for n, v, s, t in metrics
        ],
    )
    assert_same_json(job)
