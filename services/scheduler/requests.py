"""Job record → scheduler request, written once.

`job_request` is the one function that turns a stored job into what the scheduler needs
(the scheduling loop's resync enqueues it directly); `admit_request` is its thin proto
form, which the API sends to `Scheduler.Admit`, and `request_from_proto` is what the
servicer reads back. The manifest's defaults (priority, pipeline shape) come from the
manifest schema through the typed manifest (`JobRecord.spec`), never re-typed here.
"""

from __future__ import annotations

from rhizome.v1 import job_pb2, scheduler_pb2

from services.scheduler.api import JobRequest, gpus_from_float
from services.store.jobs import JobRecord


def job_request(job: JobRecord, arrival: float | None = None) -> JobRequest:
    """What the scheduler needs from a stored job (resources are per learner); `arrival`
    defaults to the job's creation time. Raises InvalidJobRequest (a SchedulerError) for
    what the scheduler cannot take, such as fractional GPUs."""
    res = job.resources
    spec = job.spec
    return JobRequest(
        job_id=job.job_id,
        learners=int(res["learners"]),
        gpus=gpus_from_float(job.job_id, float(res["gpus"])),
        gpu_type=str(res["gpu_type"]),
        cpus=float(res["cpus"]),
        memory_mb=float(res["memory_mb"]),
        owner=job.owner,
        priority=spec.priority,
        arrival=job.created_at if arrival is None else arrival,
        # Bamboo §5.1: consecutive pipeline stages in different zones where there are zones.
        zone_aware=spec.pipeline is not None and spec.pipeline.stages > 1,
    )


def request_to_proto(req: JobRequest, check_only: bool = False) -> scheduler_pb2.AdmitRequest:
    """The wire form of a request (the arrival is the scheduler's to stamp)."""
    return scheduler_pb2.AdmitRequest(
        job_id=req.job_id,
        owner=req.owner,
        priority=req.priority,
        check_only=check_only,
        max_nodes=req.max_nodes or 0,
        zone_aware=req.zone_aware,
        node_selector=dict(req.node_selector),
        resources=job_pb2.Resources(
            learners=req.learners,
            gpus=float(req.gpus),
            cpus=req.cpus,
            memory_mb=req.memory_mb,
            gpu_type=req.gpu_type,
        ),
    )


def admit_request(job: JobRecord, check_only: bool) -> scheduler_pb2.AdmitRequest:
    """`Scheduler.Admit` for a stored job: `job_request` on the wire, with the service the
    job attained before (a resumed job's)."""
    request = request_to_proto(job_request(job), check_only)
    request.attained_gpu_s = job.attained_gpu_s
    return request


def request_from_proto(req: scheduler_pb2.AdmitRequest, arrival: float) -> JobRequest:
    res = req.resources
    return JobRequest(
        job_id=req.job_id,
        learners=int(res.learners),
        gpus=gpus_from_float(req.job_id, res.gpus),
        gpu_type=res.gpu_type,
        cpus=float(res.cpus),
        memory_mb=float(res.memory_mb),
        owner=req.owner,
        priority=int(req.priority),
        arrival=arrival,
        max_nodes=int(req.max_nodes) or None,
        zone_aware=bool(req.zone_aware),
        node_selector=dict(req.node_selector),
    )
