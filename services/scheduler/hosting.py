"""How the daemon hosts the scheduler: the `rhizome.v1.Scheduler` service plus the
scheduling loop that connects the gang scheduler to the jobs in MongoDB.

Each pass of the loop (a few times a second):
1. every QUEUED job the scheduler does not know yet is queued in it (a job that can
   never fit any more fails with the reason instead of waiting forever);
2. one scheduling pass places whole gangs; each placed job moves QUEUED → PENDING with
   its placement (the LCM takes it from there). A placement the scheduler restored after
   a restart, whose job is still QUEUED, is written the same way, so a crash between the
   two writes neither loses nor double-books;
3. jobs whose borrowed quota is reclaimed are halted (not lost);
4. the explanation of every still-queued job is kept in its record (`rhizome show`);
5. the placements of jobs that no longer hold resources are released.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import grpc
from rhizome.v1 import lcm_pb2, lcm_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

from services.daemon import DaemonContext, Hosted, jobs_repository
from services.scheduler.api import JobRequest, SchedulerError, gpus_from_float
from services.scheduler.scheduler import GangScheduler
from services.scheduler.service import (
    SchedulerServicer,
    build_scheduler,
    placement_to_proto,
)
from services.store import states
from services.store.jobs import JobRecord, JobsRepository
from services.store.mongo import database_name

log = logging.getLogger("rhizome.scheduler")

DEFAULT_CLUSTER = Path(__file__).resolve().parents[2] / "deploy" / "cluster-local.yaml"
PASS_INTERVAL_S = 0.2


def job_request(job: JobRecord) -> JobRequest:
    """What the scheduler needs from a stored job (resources are per learner)."""
    res = job.resources
    manifest = job.manifest
    pipeline = manifest.get("pipeline") or {}
    return JobRequest(
        job_id=job.job_id,
        learners=int(res.get("learners", 1)),
        gpus=gpus_from_float(job.job_id, float(res.get("gpus", 0))),
        gpu_type=str(res.get("gpu_type", "")),
        cpus=float(res.get("cpus", 0)),
        memory_mb=float(res.get("memory_mb", 0)),
        owner=job.owner,
        priority=int(manifest.get("priority", 50)),
        arrival=job.created_at,
        # Bamboo §5.1: consecutive pipeline stages in different zones where there are zones.
        zone_aware=bool(pipeline) and int(pipeline.get("stages", 1)) > 1,
    )


class SchedulingLoop:
    def __init__(
        self,
        scheduler: GangScheduler,
        servicer: SchedulerServicer,
        jobs: JobsRepository,
        lcm_channel: grpc.Channel | None,
    ) -> None:
        self.scheduler = scheduler
        self.lock = servicer._lock  # the servicer and the loop share one scheduler
        self.jobs = jobs
        self.lcm = lcm_pb2_grpc.LifecycleManagerStub(lcm_channel) if lcm_channel else None
        self.stop_event = threading.Event()
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name="scheduling-loop", daemon=True)
        self._reasons: dict[str, str] = {}
        self._passes = 0
        self._pass_done = threading.Condition()
        self._last_placed: list[scheduler_pb2.JobPlacement] = []

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.wake.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        while not self.stop_event.is_set():
            self.wake.clear()
            try:
                self.run_pass()
            except Exception:  # the loop must outlive a bad pass (store hiccup, etc.)
                log.exception("scheduling pass failed; retrying")
            with self._pass_done:
                self._passes += 1
                self._pass_done.notify_all()
            self.wake.wait(PASS_INTERVAL_S)

    def pass_now(self, timeout_s: float = 5.0) -> list[scheduler_pb2.JobPlacement]:
        """Run a pass that starts after this call (coalesced with others) and return what
        it placed: the Schedule RPC, which the API calls right after storing a job."""
        with self._pass_done:
            target = self._passes + 2  # the pass running now may have missed the new job
            self.wake.set()
            self._pass_done.wait_for(lambda: self._passes >= target, timeout_s)
            return list(self._last_placed)

    def run_pass(self) -> None:
        queued = self.jobs.by_status([states.QUEUED])
        with self.lock:
            for job in queued:
                if job.job_id in self.scheduler.records:
                    continue
                try:
                    self.scheduler.enqueue(job_request(job))
                except SchedulerError as exc:
                    self._fail(job.job_id, f"cannot be scheduled: {exc}")
            result = self.scheduler.schedule()
            placements = self.scheduler.placements()
        status = {j.job_id: j.status for j in queued}
        placed = []
        for placement in placements:
            if status.get(placement.job_id) == states.QUEUED:
                self._bind(placement.job_id, list(placement.learner_nodes), placement.placed_at)
                placed.append(
                    scheduler_pb2.JobPlacement(
                        job_id=placement.job_id, placement=placement_to_proto(placement)
                    )
                )
        self._last_placed = placed
        for job_id in result.preempted:
            self._halt(job_id)
        self._explain([j for j in queued if j.job_id not in {p.job_id for p in placements}])
        self._release_finished(placements)

    def _bind(self, job_id: str, nodes: list[str], placed_at: float) -> None:
        placement = {
            "learner_nodes": {str(r): n for r, n in enumerate(nodes)},
            "placed_at": placed_at,
        }
        where = ", ".join(sorted(set(nodes)))
        try:
            self.jobs.transition(
                job_id, states.PENDING, f"placed on {where}", placement=placement, queue_reason=""
            )
        except states.IllegalTransition:
            pass  # deleted or halted meanwhile: step 5 releases it
        else:
            if self.lcm is not None:
                # Wake the LCM now rather than at its next poll; its answer does not matter.
                self.lcm.DeployJob.future(lcm_pb2.LcmJobRequest(job_id=job_id), timeout=5)
        self._reasons.pop(job_id, None)

    def _fail(self, job_id: str, reason: str) -> None:
        try:
            self.jobs.transition(job_id, states.FAILED, reason)
        except states.IllegalTransition:
            pass

    def _halt(self, job_id: str) -> None:
        reason = "halted: the owner of the quota it borrowed needs it back; resume it later"
        job = self.jobs.get(job_id)
        if job.status in (states.QUEUED, states.PENDING) or self.lcm is None:
            try:
                self.jobs.transition(job_id, states.HALTED, reason)
            except states.IllegalTransition:
                log.warning("could not halt preempted job %s (%s)", job_id, job.status)
            return
        try:
            self.lcm.HaltJob(lcm_pb2.LcmJobRequest(job_id=job_id, reason=reason), timeout=10)
        except grpc.RpcError as exc:
            log.warning("could not halt preempted job %s: %s", job_id, exc.details())

    def _explain(self, waiting: list[JobRecord]) -> None:
        for job in waiting:
            with self.lock:
                if job.job_id not in self.scheduler.records:
                    continue
                reason = self.scheduler.explain(job.job_id)
            if reason != (self._reasons.get(job.job_id) or job.queue_reason):
                self.jobs.update_fields(job.job_id, queue_reason=reason)
            self._reasons[job.job_id] = reason

    def _release_finished(self, placements: list[Any]) -> None:
        if not placements:
            return
        holding = {j.job_id for j in self.jobs.by_status([*states.ACTIVE_STATES, states.QUEUED])}
        for placement in placements:
            if placement.job_id not in holding:
                with self.lock:
                    self.scheduler.release(placement.job_id)
                log.info("released the placement of %s", placement.job_id)


class LoopedSchedulerServicer(SchedulerServicer):
    """In the daemon, `Schedule` runs a full pass of the loop (store included) at once,
    instead of a pass over only what the scheduler already holds."""

    loop: SchedulingLoop | None = None

    def Schedule(self, request: Any, context: Any) -> Any:
        if self.loop is None:
            return super().Schedule(request, context)
        return scheduler_pb2.ScheduleResponse(placements=self.loop.pass_now())


def build(ctx: DaemonContext) -> Hosted:
    """Host the Scheduler service and its loop over the jobs store."""
    cluster = ctx.config.cluster_config or str(DEFAULT_CLUSTER)
    uri = ctx.config.mongodb_uri
    scheduler = build_scheduler(
        cluster, mongo_url=uri or None, database=database_name(uri) if uri else "rhizome"
    )
    servicer = LoopedSchedulerServicer(scheduler)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, ctx.server)
    loop = SchedulingLoop(scheduler, servicer, jobs_repository(ctx), ctx.channel("lcm"))
    servicer.loop = loop
    name = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
    return Hosted([name], loop.start, loop.stop)
