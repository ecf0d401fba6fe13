"""How the daemon hosts the API: the Trainer gRPC service plus the REST gateway."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from rhizome.v1 import lcm_pb2, lcm_pb2_grpc, scheduler_pb2_grpc, tds_pb2, tds_pb2_grpc

from contract.procs import listen_failure
from services.api import errors
from services.api.core import AdmitFn, Lifecycle
from services.config import split_address
from services.hosting import DaemonContext, Hosted, jobs_repository, mongo_database, unanswered
from services.store.jobs import JobRecord

log = logging.getLogger("rhizome.api")
GAUGE_INTERVAL_S = 5.0


# How the LCM's refusals reach the user: its status code says which API error it is.
_LCM_ERRORS: dict[grpc.StatusCode, type[errors.ApiError]] = {
    grpc.StatusCode.FAILED_PRECONDITION: errors.Conflict,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: errors.BadRequest,
    grpc.StatusCode.UNIMPLEMENTED: errors.Unimplemented,
}


class LcmClient:
    """The API's lifecycle port (`services.api.core.Lifecycle`) over the LCM's RPCs: each
    call is one typed request (`LcmJobRequest`, `LcmScaleRequest`)."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.stub = lcm_pb2_grpc.LifecycleManagerStub(channel)

    def halt(self, job_id: str, reason: str) -> str:
        return self._call(self.stub.HaltJob, lcm_pb2.LcmJobRequest(job_id=job_id, reason=reason))

    def resume(self, job_id: str, reason: str) -> str:
        return self._call(self.stub.ResumeJob, lcm_pb2.LcmJobRequest(job_id=job_id, reason=reason))

    def delete(self, job_id: str, reason: str) -> str:
        return self._call(self.stub.KillJob, lcm_pb2.LcmJobRequest(job_id=job_id, reason=reason))

    def scale(self, job_id: str, learners: int, reason: str) -> str:
        request = lcm_pb2.LcmScaleRequest(job_id=job_id, learners=learners, reason=reason)
        return self._call(self.stub.ScaleJob, request)

    @staticmethod
    def _call(method: Any, request: Any) -> str:
        try:
            resp = method(request, timeout=30)
        except grpc.RpcError as exc:
            error = _LCM_ERRORS.get(exc.code())
            if error is not None:
                raise error(str(exc.details())) from None
            raise errors.Unavailable(
                f"the lifecycle manager is unavailable: {exc.details()}"
            ) from None
        if not resp.accepted:
            raise errors.Conflict(resp.message)
        return str(resp.message)


def lifecycle_client(channel: grpc.Channel | None) -> Lifecycle | None:
    """Forward halt/resume/delete/scale of deployed jobs to the LCM, when there is one."""
    return LcmClient(channel) if channel is not None else None


def admit_client(channel: grpc.Channel | None) -> AdmitFn | None:
    """The submit-time check: the scheduler refuses what can never fit, with its reason."""
    if channel is None:
        return None
    # Imported with a scheduler to talk to: the scheduler package loads numpy, which a
    # daemon hosting the API alone need not pay for at start-up.
    from services.scheduler.api import SchedulerError
    from services.scheduler.requests import admit_request

    stub = scheduler_pb2_grpc.SchedulerStub(channel)

    def admit(job: JobRecord) -> tuple[bool, str]:
        try:
            request = admit_request(job, check_only=True)
        except SchedulerError as exc:  # what no scheduler takes (fractional GPUs)
            return False, str(exc)
        try:
            resp = stub.Admit(request, timeout=10)
        except grpc.RpcError as exc:
            raise errors.Unavailable(f"the scheduler is unavailable: {exc.details()}") from None
        return bool(resp.admitted), str(resp.reason)

    return admit


class SchedulerGangs:
    """`services.api.core.ScaleGangs` over the scheduler's RPCs: admit the gang under the
    job owner's quota, run a pass, and take its placement or say why there is none."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.stub = scheduler_pb2_grpc.SchedulerStub(channel)

    def place(self, job: JobRecord, gang_id: str, learners: int) -> list[str]:
        import dataclasses

        from rhizome.v1 import scheduler_pb2

        from services.scheduler.requests import job_request, request_to_proto

        request = dataclasses.replace(job_request(job), job_id=gang_id, learners=learners)
        try:
            admitted = self.stub.Admit(request_to_proto(request), timeout=10)
            if not admitted.admitted:
                raise errors.Conflict(
                    f"cannot add {learners} learners to job {job.job_id}: {admitted.reason}"
                )
            placed = self.stub.Schedule(scheduler_pb2.ScheduleRequest(), timeout=30)
            for p in placed.placements:
                if p.job_id == gang_id:
                    return [p.placement.learner_nodes[r] for r in sorted(p.placement.learner_nodes)]
            why = self.stub.Explain(scheduler_pb2.ExplainRequest(job_id=gang_id), timeout=10)
            self.release(gang_id)
        except grpc.RpcError as exc:
            raise errors.Unavailable(f"the scheduler is unavailable: {exc.details()}") from None
        raise errors.Conflict(
            f"cannot add {learners} learners to job {job.job_id} now: {why.explanation or 'no room'}"
            " (a scale-out is placed at once or refused; try again when resources are free)"
        )

    def release(self, gang_id: str) -> None:
        from rhizome.v1 import scheduler_pb2

        with contextlib.suppress(grpc.RpcError):
            self.stub.Release(scheduler_pb2.ReleaseRequest(job_id=gang_id), timeout=10)


def scheduler_push(channel: grpc.Channel) -> Callable[[JobRecord], None]:
    """The API's `on_stored` for a scheduler in another daemon: each stored job handed to
    it by an `Admit` of its own, without making the submit wait for the answer; a push
    that fails is caught by the scheduler's periodic resync with the QUEUED records."""
    # Imported with a scheduler to talk to (numpy: see admit_client).
    from services.scheduler.api import SchedulerError
    from services.scheduler.requests import admit_request

    stub = scheduler_pb2_grpc.SchedulerStub(channel)

    def push(job: JobRecord) -> None:
        try:
            request = admit_request(job, check_only=False)
        except SchedulerError as exc:  # admission refused it already; the resync fails it
            log.warning("not pushing %s to the scheduler: %s", job.job_id, exc)
            return
        unanswered(stub.Admit.future(request, timeout=10))

    return push


class HostedScheduler:
    """The scheduler of this daemon as the API calls it: directly, no `Admit` through the
    local channel (services/scheduler/hosting.py `LocalScheduler`, which the scheduler's
    build leaves in `ctx.shared["scheduler"]`; it is built after the API, so it is looked
    up at the first call)."""

    def __init__(self, shared: dict[str, Any]) -> None:
        self._shared = shared
        self._local: Any = None

    def _scheduler(self) -> Any:
        if self._local is None:
            self._local = self._shared.get("scheduler")
        return self._local

    def admit(self, job: JobRecord) -> tuple[bool, str]:
        local = self._scheduler()
        if local is None:  # not built yet: the daemon serves only once it is
            raise errors.Unavailable("the scheduler of this daemon is not started yet")
        admitted: tuple[bool, str] = local.admit(job)
        return admitted

    def queue(self, job: JobRecord) -> None:
        local = self._scheduler()
        if local is not None:  # else the scheduler's first resync queues it
            local.queue(job)


def scheduler_ports(
    ctx: DaemonContext,
) -> tuple[AdmitFn | None, Callable[[JobRecord], None] | None]:
    """The submit's admission check and the hand-over of each stored job (the API's
    `admit` and `on_stored`): direct calls to a scheduler in this daemon, `Admit` calls
    to one elsewhere, none without a scheduler."""
    if "scheduler" in ctx.config.services:
        hosted = HostedScheduler(ctx.shared)
        return hosted.admit, hosted.queue
    channel = ctx.channel("scheduler")
    if channel is None:
        return None, None
    return admit_client(channel), scheduler_push(channel)


def tds_forget(channel: grpc.Channel) -> Callable[[str], None]:
    """Ask the TDS to delete a deleted job's logs and metrics (after their retention)."""
    stub = tds_pb2_grpc.TrainingDataStub(channel)

    def forget(job_id: str) -> None:
        def report(future: Any) -> None:
            if future.exception() is not None:
                log.warning("could not schedule deleting %s's logs: %s", job_id, future.exception())

        future = stub.DeleteJobData.future(tds_pb2.DeleteJobDataRequest(job_id=job_id), timeout=30)
        future.add_done_callback(report)
        unanswered(future)

    return forget


def build(ctx: DaemonContext) -> Hosted:
    """Host the Trainer gRPC service and the REST gateway."""
    from rhizome.v1 import trainer_pb2, trainer_pb2_grpc

    from services.api.auth import Authenticator, ensure_admin_token_file
    from services.api.core import TrainerCore
    from services.api.servicer import TrainerServicer
    from services.api.shedding import SubmitGate
    from services.objectstore.api import open_object_store
    from services.store.tokens import TokensRepository

    admit, on_stored = scheduler_ports(ctx)
    core = TrainerCore(
        jobs_repository(ctx),
        open_object_store(
            ctx.config.object_store,
            default_dir=ctx.config.objects_dir,
            endpoint_url=ctx.config.object_store_endpoint,
        ),
        admit=admit,
        lifecycle=lifecycle_client(ctx.channel("lcm")),
        gate=SubmitGate(ctx.config.max_submits_in_flight),
    )
    core.on_stored = on_stored
    scheduler_channel = ctx.channel("scheduler")
    if scheduler_channel is not None:
        core.scale_gangs = SchedulerGangs(scheduler_channel)
    tds_channel = ctx.channel("tds")
    if tds_channel is not None:
        core.on_deleted = tds_forget(tds_channel)
    ctx.shared["trainer_core"] = core
    # Job events (webhooks): registrations in MongoDB, delivered from this daemon by a
    # dispatcher of its own, so no job-side process ever waits on a receiver.
    from services.events.delivery import Dispatcher
    from services.events.store import MongoEventEndpoints

    core.events = endpoints = MongoEventEndpoints(mongo_database(ctx))
    endpoints.ensure_indexes()
    dispatcher = Dispatcher(endpoints, lambda job_id: core.jobs.get(job_id))
    tokens = TokensRepository(mongo_database(ctx))
    tokens.ensure_indexes()
    if ctx.config.admin_token_file:
        ensure_admin_token_file(tokens, Path(ctx.config.admin_token_file))
    auth = Authenticator(tokens, ctx.config.trust_user_header, ctx.config.auth_cache_s)
    if auth.trust_user_header:
        log.warning(
            "--insecure-trust-user-header is on: a caller without a token is whoever its "
            "x-rhizome-user / X-Rhizome-User header says (FfDL compatibility); use tokens instead"
        )
    servicer = TrainerServicer(
        core,
        tds_channel=ctx.channel("tds"),
        scheduler_channel=ctx.channel("scheduler"),
        services=list(ctx.config.services),
        auth=auth,
    )
    trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, ctx.server)
    rest: dict[str, Any] = {}

    def start_rest() -> None:
        # FastAPI and uvicorn are imported only now (Hosted.start_late): a restarted
        # daemon answers gRPC calls and leads while the REST gateway is still loading.
        import uvicorn

        from services.api.rest import build_app

        app = build_app(
            core,
            ctx.channel("tds"),
            auth,
            ctx.channel("scheduler"),
            ctx.config.data_dir,
            ctx.config.quota_config,
        )
        from services.leader.gate import rest_gate

        app = rest_gate(app, ctx.leading)  # a hot standby answers 503 until it leads
        host, port = split_address(ctx.config.rest_address)
        # httptools (C) named rather than uvicorn's "auto", which falls back to the
        # pure-Python h11 without a word when httptools is missing: a REST submit cost the
        # daemon twice a gRPC one's CPU (issue #18), and the HTTP parsing is part of it.
        from services.api.rest_http import RestHttpProtocol

        http: dict[str, Any] = {"http": RestHttpProtocol}
        if ctx.config.tls_cert:  # the same certificate as the public gRPC port
            from services.api.tls_writes import GatheringRestHttpProtocol

            http = {
                "ssl_certfile": ctx.config.tls_cert,
                "ssl_keyfile": ctx.config.tls_key,
                # one TLS record per response, not one per part (tls_writes.py: why)
                "http": GatheringRestHttpProtocol,
            }
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", access_log=False, **http
        )
        server = uvicorn.Server(config)
        # The daemon owns signal handling; uvicorn must not replace its handlers.
        setattr(server, "install_signal_handlers", lambda: None)  # noqa: B010
        thread = threading.Thread(target=server.run, name="rest-gateway", daemon=True)
        thread.start()
        rest["server"], rest["thread"] = server, thread
        deadline = time.monotonic() + 10
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not server.started:
            raise listen_failure("the REST gateway (--rest-address)", ctx.config.rest_address)
        gauges.start()

    def publish_job_gauges() -> None:
        from services.metrics import JOBS_BY_STATE, QUEUE_LENGTH

        while not gauges_stop.wait(GAUGE_INTERVAL_S):
            try:
                counts = core.jobs.count_by_status()
            except Exception:  # a store hiccup: try again next tick
                continue
            for state, n in counts.items():
                JOBS_BY_STATE.labels(state=state).set(n)
            QUEUE_LENGTH.labels(queue="all").set(counts.get("QUEUED", 0))

    gauges_stop = threading.Event()
    gauges = threading.Thread(target=publish_job_gauges, name="job-gauges", daemon=True)

    def stop() -> None:
        gauges_stop.set()
        dispatcher.stop()
        if "server" in rest:
            rest["server"].should_exit = True
            rest["thread"].join(timeout=5)

    # Webhooks are delivered by the leading daemon only: two dispatchers would race on
    # the delivery cursors.
    return Hosted(
        [trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name],
        stop=stop,
        lead=dispatcher.start,
        start_late=start_rest,
    )
