"""JobRecord (the store's view) <-> rhizome.v1.Job (the wire's view)."""

from __future__ import annotations

import datetime
import math
from typing import Any

from google.protobuf import struct_pb2, timestamp_pb2
from rhizome.v1 import job_pb2, trainer_pb2

from services.events.api import EndpointRecord
from services.store import states
from services.store.jobs import JobRecord
from services.store.tokens import TokenRecord


def timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def _resources(job: JobRecord) -> dict[str, Any]:
    """The record's resources as `Resources`' fields, typed, with their defaults."""
    res = job.resources
    return {
        "learners": int(res.get("learners", 1)),
        "gpus": float(res.get("gpus", 0)),
        "cpus": float(res.get("cpus", 1)),
        "memory_mb": float(res.get("memory_mb", 0)),
        "gpu_type": str(res.get("gpu_type", "")),
    }


def _metric_fields(m: dict[str, Any]) -> dict[str, Any]:
    """A `last_metrics` entry as `LastMetric`'s fields (`time` in seconds)."""
    return {
        "name": str(m.get("name", "")),
        "value": float(m.get("value", 0.0)),
        "step": int(m.get("step", 0)),
        "time": float(m.get("time", 0.0)),
        "learner": int(m.get("learner", 0)),
    }


def _checkpoint_fields(c: dict[str, Any]) -> dict[str, Any]:
    """A `checkpoints` entry as `CheckpointTaken`'s fields (`time` in seconds)."""
    return {
        "kind": str(c.get("kind", "")),
        "step": int(c.get("step", 0)),
        "size_bytes": int(c.get("size_bytes", 0)),
        "time": float(c.get("time", 0.0)),
        "learner": str(c.get("learner", "")),
        "name": str(c.get("name", "")),
    }


def job_to_proto(job: JobRecord) -> job_pb2.Job:
    manifest = struct_pb2.Struct()
    manifest.update(job.spec.redacted())  # data-store credentials never leave the store
    msg = job_pb2.Job(
        job_id=job.job_id,
        owner=job.owner,
        name=job.name,
        display_name=job.spec.display_name or job.name,
        description=job.description,
        status=states.to_proto(job.status),  # type: ignore[arg-type]
        status_message=job.status_message,
        history=[
            job_pb2.StatusEvent(
                status=states.to_proto(h.status),  # type: ignore[arg-type]
                time=timestamp(h.time),
                message=h.message,
            )
            for h in job.history
        ],
        resources=job_pb2.Resources(**_resources(job)),
        manifest=manifest,
        created_at=timestamp(job.created_at),
        updated_at=timestamp(job.updated_at),
        attempts=job.attempts,
        idempotency_key=job.idempotency_key,
        queue_reason=job.queue_reason,
        exit_code=job.exit_code,
        last_log_lines=job.last_log_lines,
        last_metrics=[
            job_pb2.LastMetric(**{**f, "time": timestamp(f["time"])})
            for f in map(_metric_fields, job.last_metrics)
        ],
        checkpoints=[
            job_pb2.CheckpointTaken(**{**f, "time": timestamp(f["time"])})
            for f in map(_checkpoint_fields, job.checkpoints)
        ],
    )
    if job.placement:
        nodes = job.placement.get("learner_nodes", {})
        msg.placement.learner_nodes.update({int(k): str(v) for k, v in nodes.items()})
        msg.placement.placed_at.CopyFrom(timestamp(float(job.placement.get("placed_at", 0))))
    return msg


def token_to_proto(token: TokenRecord) -> trainer_pb2.Token:
    """A token as the API shows it: never its secret nor the secret's hash."""
    msg = trainer_pb2.Token(
        token_id=token.token_id,
        user=token.user,
        role=token.role,
        prefix=token.prefix,
        created_at=timestamp(token.created_at),
        created_by=token.created_by,
        description=token.description,
    )
    if token.expires_at:
        msg.expires_at.CopyFrom(timestamp(token.expires_at))
    if token.revoked_at:
        msg.revoked_at.CopyFrom(timestamp(token.revoked_at))
    return msg


def endpoint_to_proto(endpoint: EndpointRecord) -> trainer_pb2.EventEndpoint:
    """A webhook as the API shows it: never its signing secret."""
    return trainer_pb2.EventEndpoint(
        endpoint_id=endpoint.endpoint_id,
        job_id=endpoint.job_id,
        event_type=endpoint.event_type,
        url=endpoint.url,
        created_at=timestamp(endpoint.created_at),
    )


# -- a job as the REST gateway answers it ------------------------------------------------
# `job_json` is what `MessageToDict(job_to_proto(job), preserving_proto_field_name=True)`
# gives, built straight from the record: the proto and its generic JSON walk were a tenth
# of a REST submit's daemon CPU (issue #18). The proto3 JSON rules it follows: a field at
# its default (0, "", empty) is left out, a message field set is always there, int64 is a
# string, a double stays a float (a Struct's numbers too), fields in number order.
# tests/services/api/test_job_json.py holds it to the generic walk.


def _json_time(seconds: float) -> str:
    """`timestamp(seconds).ToJsonString()`: RFC 3339, 0, 3, 6 or 9 fractional digits."""
    whole, nanos = divmod(int(seconds * 1e9), 1_000_000_000)
    text = (_EPOCH + datetime.timedelta(seconds=whole)).isoformat()
    if nanos == 0:
        return text + "Z"
    if nanos % 1_000_000 == 0:
        return f"{text}.{nanos // 1_000_000:03d}Z"
    if nanos % 1000 == 0:
        return f"{text}.{nanos // 1000:06d}Z"
    return f"{text}.{nanos:09d}Z"


_EPOCH = datetime.datetime(1970, 1, 1)


def _struct_value(value: Any) -> Any:
    """A value of a `Struct` as its JSON: every number a float. ValueError for what
    `Struct.update` or its JSON refuses."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError(f"{value} has no JSON form")
        return float(value)
    if isinstance(value, dict):
        return _struct_json(value)
    if isinstance(value, list | tuple):
        return [_struct_value(v) for v in value]
    raise ValueError(f"a Struct holds no {type(value).__name__}")


def _struct_json(mapping: dict[Any, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise ValueError(f"a Struct's keys are strings, not {type(key).__name__}")
        out[key] = _struct_value(value)
    return out


def _some(out: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """`out` with the fields not at their default (proto3 JSON leaves those out)."""
    out.update((k, v) for k, v in fields.items() if not _default(v))
    return out


def _default(value: Any) -> bool:
    """A field's default: 0, "", empty; a double -0.0 is not (its bits are not zero's)."""
    if isinstance(value, float):
        return value == 0.0 and math.copysign(1.0, value) > 0
    return not value


def job_json(job: JobRecord) -> dict[str, Any]:
    """A job's JSON as `MessageToDict(job_to_proto(job), preserving_proto_field_name=True)`
    gives it, but for the order of a manifest's keys: the record's, where the Struct's
    walk follows its hash order (which changes from one process to the next). ValueError
    for a manifest no Struct holds."""
    status = states.to_proto(job.status)
    out: dict[str, Any] = _some(
        {},
        job_id=job.job_id,
        owner=job.owner,
        name=job.name,
        description=job.description,
        status=job.status if status else "",
        status_message=job.status_message,
        history=[
            _some(
                {},
                status=h.status if states.to_proto(h.status) else "",
                time=_json_time(h.time),
                message=h.message,
            )
            for h in job.history
        ],
    )
    out["resources"] = _some({}, **_resources(job))
    out["manifest"] = _struct_json(job.spec.redacted())
    out["created_at"] = _json_time(job.created_at)
    out["updated_at"] = _json_time(job.updated_at)
    if job.placement:
        # the ranks in the order of the proto's map (its hash order): built as job_to_proto
        # builds it, for the order alone (a placed job's record only)
        ranks = job_pb2.Placement()
        ranks.learner_nodes.update(
            {int(k): str(v) for k, v in job.placement.get("learner_nodes", {}).items()}
        )
        out["placement"] = _some(
            {}, learner_nodes={str(r): ranks.learner_nodes[r] for r in ranks.learner_nodes}
        )
        out["placement"]["placed_at"] = _json_time(float(job.placement.get("placed_at", 0)))
    return _some(
        out,
        attempts=job.attempts,
        idempotency_key=job.idempotency_key,
        queue_reason=job.queue_reason,
        exit_code=job.exit_code,
        last_log_lines=list(job.last_log_lines),
        display_name=job.spec.display_name or job.name,
        last_metrics=[
            _some({}, **{**f, "step": _int64(f["step"]), "time": _json_time(f["time"])})
            for f in map(_metric_fields, job.last_metrics)
        ],
        checkpoints=[
            _some(
                {},
                **{
                    **f,
                    "step": _int64(f["step"]),
                    "size_bytes": _int64(f["size_bytes"]),
                    "time": _json_time(f["time"]),
                },
            )
            for f in map(_checkpoint_fields, job.checkpoints)
        ],
    )


def _int64(value: Any) -> str:
    """An int64 field's JSON: a string ("" for 0, left out)."""
    number = int(value)
    return str(number) if number else ""
