"""What the CLI's `--json` prints for an API message (services/client/json_view.py):
every field, zero values included, and 64-bit integers as numbers, nested ones too."""

from __future__ import annotations

import json

from google.protobuf import json_format
from rhizome.v1 import job_pb2, tds_pb2

from services.client.json_view import message_dict


def test_a_zero_field_is_printed_and_64_bit_integers_are_numbers() -> None:
    sample = tds_pb2.MetricSample(job_id="job-1", learner=0, seq=7, name="loss", step=0)
    # protobuf's own mapping, what the CLI printed before: no learner, no step, seq "7"
    plain = json_format.MessageToDict(sample, preserving_proto_field_name=True)
    assert "learner" not in plain and "step" not in plain and plain["seq"] == "7"

    data = message_dict(sample)
    assert data["learner"] == 0 and data["step"] == 0 and data["seq"] == 7
    assert data["value"] == 0.0 and data["source"] == ""
    assert json.loads(json.dumps(data)) == data


def test_nested_and_repeated_64_bit_integers_are_numbers_and_well_known_types_kept() -> None:
    job = job_pb2.Job(
        job_id="job-1",
        checkpoints=[
            job_pb2.CheckpointTaken(kind="periodic", step=3, size_bytes=2048, learner="0"),
            job_pb2.CheckpointTaken(kind="insurance", step=0, size_bytes=4096),
        ],
        last_metrics=[job_pb2.LastMetric(name="loss", value=0.5, step=12, learner=0)],
    )
    job.manifest.update({"name": "m", "learners": 2})
    job.checkpoints[0].time.FromSeconds(1_700_000_000)

    data = message_dict(job)
    assert [(c["step"], c["size_bytes"]) for c in data["checkpoints"]] == [(3, 2048), (0, 4096)]
    assert data["last_metrics"] == [
        {"name": "loss", "value": 0.5, "step": 12, "learner": 0}
    ]  # no time set: a message field without presence stays out
    assert data["checkpoints"][0]["time"] == "2023-11-14T22:13:20Z"  # Timestamp's own form
    assert data["manifest"] == {"name": "m", "learners": 2.0}  # Struct's own form
    assert data["history"] == [] and data["last_log_lines"] == []
