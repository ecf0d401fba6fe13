"""How the daemon hosts the API: the Trainer gRPC service plus the REST gateway."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
from rhizome.v1 import lcm_pb2, lcm_pb2_grpc

from services.api import errors
from services.api.core import LifecycleFn
from services.config import split_address
from services.daemon import DaemonContext, Hosted, jobs_repository


def lifecycle_client(channel: grpc.Channel | None) -> LifecycleFn | None:
    """Forward halt/resume/delete/scale of deployed jobs to the LCM over its RPCs."""
    if channel is None:
        return None
    stub = lcm_pb2_grpc.LifecycleManagerStub(channel)

    def call(job_id: str, action: str, reason: str) -> str:
        try:
            if action.startswith("scale:"):
                learners = int(action.split(":", 1)[1])
                resp = stub.ScaleJob(
                    lcm_pb2.LcmScaleRequest(job_id=job_id, learners=learners), timeout=30
                )
            else:
                method = {"halt": stub.HaltJob, "resume": stub.ResumeJob, "delete": stub.KillJob}[
                    action
                ]
                resp = method(lcm_pb2.LcmJobRequest(job_id=job_id, reason=reason), timeout=30)
        except grpc.RpcError as exc:
            raise errors.Unavailable(
                f"the lifecycle manager is unavailable: {exc.details()}"
            ) from None
        if not resp.accepted:
            raise errors.Conflict(resp.message)
        return str(resp.message)

    return call


def build(ctx: DaemonContext) -> Hosted:
    """Host the Trainer gRPC service and the REST gateway."""
    from rhizome.v1 import trainer_pb2, trainer_pb2_grpc

    from services.api.core import TrainerCore
    from services.api.grpc_service import TrainerServicer
    from services.api.rest import build_app
    from services.store.objects import LocalObjectStore

    core = TrainerCore(
        jobs_repository(ctx),
        LocalObjectStore(ctx.config.objects_dir),
        lifecycle=lifecycle_client(ctx.channel("lcm")),
    )
    ctx.shared["trainer_core"] = core
    servicer = TrainerServicer(
        core,
        tds_channel=ctx.channel("tds"),
        scheduler_channel=ctx.channel("scheduler"),
        services=list(ctx.config.services),
    )
    trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, ctx.server)
    app = build_app(core, ctx.channel("tds"))
    rest: dict[str, Any] = {}

    def start() -> None:
        import uvicorn

        host, port = split_address(ctx.config.rest_address)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
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
            raise RuntimeError(f"the REST gateway could not listen on {ctx.config.rest_address}")

    def stop() -> None:
        if "server" in rest:
            rest["server"].should_exit = True
            rest["thread"].join(timeout=5)

    return Hosted([trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name], start, stop)
