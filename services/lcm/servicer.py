"""The `rhizome.v1.LifecycleManager` RPCs, answered by any LCM replica."""

from __future__ import annotations

import grpc
from rhizome.v1 import lcm_pb2, lcm_pb2_grpc

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
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, scale_not_supported(request))
        raise AssertionError("unreachable: abort raises")

    def _guard(self, context: grpc.ServicerContext, fn, *args: str) -> lcm_pb2.LcmResponse:  # type: ignore[no-untyped-def]
        try:
            return self._answer(fn, *args)
        except StoreUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            raise  # unreachable: abort raises


def scale_not_supported(request: lcm_pb2.LcmScaleRequest) -> str:
    """Why a running job cannot be scaled yet, and what to do instead."""
    job, n = request.job_id, request.learners
    return (
        f"job {job}: scaling a running job is not supported yet (it needs the elastic "
        "runtime, which the local backend does not run); to run it with "
        f"{n} learners, halt it (`rhizome halt {job}`), scale it while it is halted "
        f"(`rhizome scale {job} {n}`), and resume it (`rhizome resume {job}`)"
    )
