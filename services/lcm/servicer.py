"""The `rhizome.v1.LifecycleManager` RPCs, answered by any LCM replica."""

from __future__ import annotations

import grpc
from rhizome.v1 import lcm_pb2, lcm_pb2_grpc

from services.guardian.elastic import ScaleRefused, request_scale
from services.lcm.manager import LifecycleManager
from services.store import states
from services.store.errors import JobNotFound, StaleToken, StoreUnavailable


class LifecycleServicer(lcm_pb2_grpc.LifecycleManagerServicer):
    def __init__(self, manager: LifecycleManager) -> None:
        self.manager = manager

    def _answer(self, fn, *args: str) -> lcm_pb2.LcmResponse:  # type: ignore[no-untyped-def]
        try:
            return lcm_pb2.LcmResponse(accepted=True, message=fn(*args))
        except (JobNotFound, states.IllegalTransition, StaleToken) as exc:
            return lcm_pb2.LcmResponse(accepted=False, message=str(exc))

    def DeployJob(
        self, request: lcm_pb2.LcmJobRequest, context: grpc.ServicerContext
    ) -> lcm_pb2.LcmResponse:
        def deploy(job_id: str) -> str:
            job = self.manager.jobs.get(job_id)
            if job.status not in states.ACTIVE_STATES:
                raise states.IllegalTransition(job_id, job.status, states.DEPLOYING)
            self.manager.wake.set()
            return f"job {job_id} will be deployed"

        return self._guard(context, deploy, request.job_id)

    def HaltJob(
        self, request: lcm_pb2.LcmJobRequest, context: grpc.ServicerContext
    ) -> lcm_pb2.LcmResponse:
        return self._guard(
            context,
            self.manager.request,
            request.job_id,
            "halt",
            request.reason or "halted by user",
        )

    def KillJob(
        self, request: lcm_pb2.LcmJobRequest, context: grpc.ServicerContext
    ) -> lcm_pb2.LcmResponse:
        return self._guard(
            context,
            self.manager.request,
            request.job_id,
            "delete",
            request.reason or "deleted by user",
        )

    def ResumeJob(
        self, request: lcm_pb2.LcmJobRequest, context: grpc.ServicerContext
    ) -> lcm_pb2.LcmResponse:
        return self._guard(
            context, self.manager.resume, request.job_id, request.reason or "resumed by user"
        )

    def ScaleJob(
        self, request: lcm_pb2.LcmScaleRequest, context: grpc.ServicerContext
    ) -> lcm_pb2.LcmResponse:
        def scale(job_id: str) -> str:
            try:
                return request_scale(
                    self.manager.etcd, self.manager.jobs, job_id, request.learners, request.reason
                )
            except ScaleRefused as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
                raise  # unreachable: abort raises

        return self._guard(context, scale, request.job_id)

    def _guard(self, context: grpc.ServicerContext, fn, *args: str) -> lcm_pb2.LcmResponse:  # type: ignore[no-untyped-def]
        try:
            return self._answer(fn, *args)
        except StoreUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            raise  # unreachable: abort raises
