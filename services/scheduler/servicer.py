"""The gRPC servicer for ``rhizome.v1.Scheduler``, wrapping one GangScheduler.

- ``Admit``    validates and queues the job (admission = submit); a job that can never
               run is refused with the reason (``admitted=false``). Re-admitting the
               same job id with the same resources is a no-op.
- ``Schedule`` runs one scheduling pass and returns the placements made. Decisions are
               persisted *before* the reply; after a restart, reservations reloaded
               from the store are returned once more in the next reply, because the
               caller may never have seen them (the LCM treats a repeated placement
               of a job it already placed as a no-op).
- ``ReplaceLearner`` a gang of one for a placed job's lost learner (``placed=false`` and
               the reason when no node has room: the caller waits and asks again).
- ``Release``, ``Explain``, ``GetCluster`` as named.

Jobs to halt so that borrowed quota returns to its owner are in
``ScheduleResponse.preempted_job_ids``. ``Confirm`` turns a reservation into a binding.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import timestamp_pb2
from rhizome.v1 import job_pb2, scheduler_pb2, scheduler_pb2_grpc

from services.rpc_guard import MalformedRequestInterceptor
from services.scheduler.api import (
    AdmitResult,
    NoRoomForLearner,
    Placement,
    SchedulerError,
    UnknownJob,
)
from services.scheduler.cluster import load_cluster_config
from services.scheduler.persist import MongoPlacementStore
from services.scheduler.quota import load_quota_config
from services.scheduler.requests import request_from_proto
from services.scheduler.scheduler import GangScheduler

log = logging.getLogger(__name__)


def placement_to_proto(p: Placement) -> job_pb2.Placement:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(p.placed_at * 1e9))
    return job_pb2.Placement(
        learner_nodes={rank: node for rank, node in enumerate(p.learner_nodes)}, placed_at=ts
    )


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, scheduler: GangScheduler, clock: Callable[[], float] = time.time) -> None:
        self.scheduler = scheduler
        self.clock = clock
        self._lock = threading.Lock()
        # reloaded reservations the caller may not have heard of: sent once more
        self._redeliver: list[str] = list(scheduler.restored_reservations)

    def Admit(self, request: Any, context: Any) -> Any:
        try:
            job = request_from_proto(request, self.clock())
            if request.check_only:
                # Admission reads only the empty cluster and the quota config, neither of
                # which a scheduling pass changes: no need to wait for the lock.
                result = self.scheduler.admit(job)
            else:
                with self._lock:
                    # checked by enqueue, unless this request passed the API's check
                    # (check_only) moments ago: each submit is checked once
                    self.scheduler.enqueue(job, attained_gpu_s=request.attained_gpu_s)
                result = AdmitResult(True)
        except SchedulerError as exc:
            return scheduler_pb2.AdmitResponse(admitted=False, reason=str(exc))
        return scheduler_pb2.AdmitResponse(admitted=result.admitted, reason=result.reason)

    def Schedule(self, request: Any, context: Any) -> Any:
        with self._lock:
            result = self.scheduler.schedule()
            placements = list(result.placements)
            fresh = {p.job_id for p in placements}
            for job_id in self._redeliver:
                if job_id in self.scheduler.records and job_id not in fresh:
                    p = self.scheduler.placement(job_id)
                    if p is not None:
                        placements.append(p)
            self._redeliver = []
        for job_id in result.preempted:
            log.warning("job %s must be halted: its borrowed quota is needed by its owner", job_id)
        return scheduler_pb2.ScheduleResponse(
            placements=[
                scheduler_pb2.JobPlacement(job_id=p.job_id, placement=placement_to_proto(p))
                for p in placements
            ],
            preempted_job_ids=list(result.preempted),
        )

    def Confirm(self, request: Any, context: Any) -> Any:
        with self._lock:
            try:
                self.scheduler.confirm(request.job_id)
            except SchedulerError as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
                raise
        return scheduler_pb2.ConfirmResponse(confirmed=True)

    def Release(self, request: Any, context: Any) -> Any:
        with self._lock:
            released = self.scheduler.release(request.job_id)
        return scheduler_pb2.ReleaseResponse(released=released)

    def Explain(self, request: Any, context: Any) -> Any:
        with self._lock:
            try:
                text = self.scheduler.explain(request.job_id)
            except UnknownJob as exc:
                context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
                raise  # abort raises; this keeps type checkers honest
        return scheduler_pb2.ExplainResponse(explanation=text)

    def ReplaceLearner(self, request: Any, context: Any) -> Any:
        with self._lock:
            try:
                placement = self.scheduler.replace_learner(request.job_id, request.rank)
            except NoRoomForLearner as exc:
                return scheduler_pb2.ReplaceLearnerResponse(placed=False, reason=str(exc))
            except UnknownJob as exc:
                context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
                raise
            except SchedulerError as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
                raise
        return scheduler_pb2.ReplaceLearnerResponse(
            placed=True,
            node=placement.learner_nodes[request.rank],
            placement=placement_to_proto(placement),
        )

    def GetCluster(self, request: Any, context: Any) -> Any:
        with self._lock:
            view = self.scheduler.cluster_view()
        return scheduler_pb2.ClusterView(
            nodes=[
                scheduler_pb2.NodeView(
                    name=n.name,
                    gpu_type=n.gpu_type,
                    gpus_total=n.gpus_total,
                    gpus_free=n.gpus_free,
                    cpus_total=n.cpus_total,
                    cpus_free=n.cpus_free,
                    memory_mb_total=n.memory_mb_total,
                    memory_mb_free=n.memory_mb_free,
                    zone=n.zone,
                    labels=dict(n.labels),
                    price_per_hour=n.price_per_hour,
                )
                for n in view.nodes
            ],
            queued_jobs=view.queued_jobs,
            running_jobs=view.running_jobs,
        )


def build_scheduler(
    cluster_config: str | Path,
    *,
    mongo_url: str | None = None,
    database: str = "rhizome",
    quota_config: str | Path | None = None,
    policy: str = "pack",
    seed: int = 0,
) -> GangScheduler:
    """A scheduler from config files, persisting to MongoDB when ``mongo_url`` is given."""
    cluster = load_cluster_config(cluster_config)
    quotas = load_quota_config(quota_config, cluster.gpu_types) if quota_config else None
    store = MongoPlacementStore.from_url(mongo_url, database) if mongo_url else None
    return GangScheduler(cluster, policy=policy, quotas=quotas, seed=seed, store=store)


def add_to_server(server: grpc.Server, scheduler: GangScheduler) -> SchedulerServicer:
    servicer = SchedulerServicer(scheduler)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    return servicer


def build_server(
    scheduler: GangScheduler, address: str = "127.0.0.1:0", max_workers: int = 4
) -> tuple[grpc.Server, int]:
    """A started-ready (not started) server with the servicer; returns it and its port."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=[MalformedRequestInterceptor()],
    )
    add_to_server(server, scheduler)
    port = server.add_insecure_port(address)
    return server, port
