"""JobRecord (the store's view) <-> rhizome.v1.Job (the wire's view)."""

from __future__ import annotations

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


def job_to_proto(job: JobRecord) -> job_pb2.Job:
    manifest = struct_pb2.Struct()
    manifest.update(job.spec.redacted())  # data-store credentials never leave the store
    res = job.resources
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
        resources=job_pb2.Resources(
            learners=int(res.get("learners", 1)),
            gpus=float(res.get("gpus", 0)),
            cpus=float(res.get("cpus", 1)),
            memory_mb=float(res.get("memory_mb", 0)),
            gpu_type=str(res.get("gpu_type", "")),
        ),
        manifest=manifest,
        created_at=timestamp(job.created_at),
        updated_at=timestamp(job.updated_at),
        attempts=job.attempts,
        idempotency_key=job.idempotency_key,
        queue_reason=job.queue_reason,
        exit_code=job.exit_code,
        last_log_lines=job.last_log_lines,
        last_metrics=[
            job_pb2.LastMetric(
                name=str(m.get("name", "")),
                value=float(m.get("value", 0.0)),
                step=int(m.get("step", 0)),
                time=timestamp(float(m.get("time", 0.0))),
                learner=int(m.get("learner", 0)),
            )
            for m in job.last_metrics
        ],
        checkpoints=[
            job_pb2.CheckpointTaken(
                kind=str(c.get("kind", "")),
                step=int(c.get("step", 0)),
                size_bytes=int(c.get("size_bytes", 0)),
                time=timestamp(float(c.get("time", 0.0))),
                learner=str(c.get("learner", "")),
                name=str(c.get("name", "")),
            )
            for c in job.checkpoints
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
