"""How the daemon hosts the LCM: the LifecycleManager RPCs plus the reconcile loop."""

from __future__ import annotations

import click

from services.hosting import DaemonContext, Hosted, jobs_repository


def build(ctx: DaemonContext) -> Hosted:
    from rhizome.v1 import lcm_pb2, lcm_pb2_grpc

    from contract.etcd import EtcdClient
    from services.lcm.manager import LcmConfig, LifecycleManager
    from services.lcm.servicer import LifecycleServicer

    config = ctx.config
    if not config.etcd_url:
        raise click.UsageError(
            "the lcm needs etcd: pass --etcd http://HOST:PORT or set RHIZOME_ETCD"
        )
    # Learners ship their logs to the TDS's internal port, with their job's token.
    tds = config.internal_address if "tds" in config.services else config.peers.get("tds", "")
    tds = config.learner_tds_address or tds
    has_scheduler = "scheduler" in config.services or "scheduler" in config.peers
    # Guardians ask the scheduler where a lost pipeline learner's replacement runs.
    scheduler = (
        config.internal_address
        if "scheduler" in config.services
        else config.peers.get("scheduler", "")
    )
    manager = LifecycleManager(
        LcmConfig(
            data_dir=config.data_dir,
            etcd_url=config.etcd_url,
            mongodb_uri=config.mongodb_uri,
            tds_address=tds,
            place_locally=not has_scheduler,
            backend=config.backend,
            job_token=ctx.credentials.job_token if ctx.credentials else None,
            job_tls=ctx.internal_tls.job_credentials if ctx.internal_tls else None,
            scheduler_address=scheduler,
            service_token=ctx.credentials.service_token if ctx.credentials else None,
        ),
        jobs_repository(ctx),
        EtcdClient.connect(config.etcd_url),
    )
    ctx.shared["lcm"] = manager
    lcm_pb2_grpc.add_LifecycleManagerServicer_to_server(LifecycleServicer(manager), ctx.server)
    name = lcm_pb2.DESCRIPTOR.services_by_name["LifecycleManager"].full_name
    return Hosted([name], manager.start, manager.stop)
