"""How the daemon hosts the LCM: the LifecycleManager RPCs plus the reconcile loop."""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from services.hosting import DaemonContext, Hosted, jobs_repository

if TYPE_CHECKING:
    from services.security.tls import InternalTls


def build(ctx: DaemonContext) -> Hosted:
    from rhizome.v1 import lcm_pb2, lcm_pb2_grpc

    from contract.etcd import (
        ETCD_ROOT_CREDENTIALS_FILE,
        EtcdAuthError,
        EtcdClient,
        root_credentials_from_env,
    )
    from services.guardian.config import learner_lease_ttl_from_env
    from services.lcm.manager import LcmConfig, LifecycleManager
    from services.lcm.servicer import LifecycleServicer

    config = ctx.config
    if not config.etcd_url:
        raise click.UsageError(
            "the lcm needs etcd: pass --etcd http://HOST:PORT or set RHIZOME_ETCD"
        )
    try:  # the guardians read it from our environment: refused here, not by each of them
        learner_lease_ttl_from_env()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    # Learners ship their logs to the TDS's internal port, with their job's token.
    tds = config.internal_address if "tds" in config.services else config.peers.get("tds", "")
    tds = config.learner_tds_address or tds
    has_scheduler = "scheduler" in config.services or "scheduler" in config.peers
    try:  # etcd's root user, to make each job's own etcd user (`rhizome up` gives it)
        etcd_root = root_credentials_from_env()
    except EtcdAuthError as exc:
        raise click.UsageError(str(exc)) from exc
    # Read once and dropped: the guardians and everything they start inherit our
    # environment, and none of them may act as etcd's root.
    os.environ.pop(ETCD_ROOT_CREDENTIALS_FILE, None)
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
            job_tls=_job_certificates(ctx.internal_tls, config.backend)
            if ctx.internal_tls
            else None,
            etcd_root=etcd_root,
            job_tls_dir=ctx.internal_tls.directory if ctx.internal_tls else None,
            scheduler_address=scheduler,
            service_token=ctx.credentials.service_token if ctx.credentials else None,
            guardians_per_host=guardians_per_host_from_env()
            if config.guardians_per_host is None
            else config.guardians_per_host,
        ),
        jobs_repository(ctx),
        EtcdClient.connect(config.etcd_url),
    )
    ctx.shared["lcm"] = manager
    lcm_pb2_grpc.add_LifecycleManagerServicer_to_server(LifecycleServicer(manager), ctx.server)
    name = lcm_pb2.DESCRIPTOR.services_by_name["LifecycleManager"].full_name
    # The rounds (and the guardians they run) are the leader's work: a hot standby starts
    # them at takeover, when the guardians of the dead daemon are re-adopted.
    return Hosted([name], None, manager.stop, lead=manager.start)


GUARDIANS_PER_HOST_ENV = "RHIZOME_GUARDIANS_PER_HOST"
# Hosts by default: at N=50 a hosted job's guardian cost x0.027 the memory and x0.134 the
# CPU of a process per job (benchmarks/RESULTS.md), and the platform's integration tests
# pass with hosts on (docs/control-plane-scale.md). 100 jobs a host keeps a host's crash
# (its guardians only; learners run on) and its GIL shared by few enough jobs, and spreads
# 1,000 jobs over 10 processes, so over cores.
DEFAULT_GUARDIANS_PER_HOST = 100


class GuardiansPerHost(click.ParamType):
    """A whole number of jobs per guardian host, 0 or more; anything else is a usage error
    naming the flag (click adds `--guardians-per-host`, and the variable when it came
    from there)."""

    name = "N"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        raw = str(value).strip()
        try:
            number = int(raw)
        except ValueError:
            number = -1
        if number < 0:
            source = ctx.get_parameter_source(param.name) if ctx and param and param.name else None
            where = (
                f" (from ${GUARDIANS_PER_HOST_ENV})"
                if source == click.core.ParameterSource.ENVIRONMENT
                else ""
            )
            self.fail(
                f"{raw!r}{where} is not a whole number of jobs per guardian host "
                "(0: a guardian process per job)",
                param,
                ctx,
            )
        return number


def guardians_per_host_from_env() -> int:
    """`$RHIZOME_GUARDIANS_PER_HOST` checked as the flag is (unset or empty: the default):
    the LcmConfig default, so an LCM built without the daemon (tests, benchmarks) follows
    the same variable as `rhizomed`."""
    raw = os.environ.get(GUARDIANS_PER_HOST_ENV, "").strip()
    if not raw:
        return DEFAULT_GUARDIANS_PER_HOST
    try:
        return GuardiansPerHost().convert(raw, None, None)
    except click.BadParameter as exc:
        raise click.UsageError(f"${GUARDIANS_PER_HOST_ENV}: {exc.message}") from exc


GUARDIANS_PER_HOST_HELP = (
    "Run the guardians of up to N jobs in one guardian host process (one etcd lease, one "
    "watch, one MongoDB client for all of them; pipeline and elastic jobs keep a process "
    "each); 0: a guardian process per job. docs/control-plane-scale.md."
)

F = TypeVar("F", bound=Callable[..., Any])


def guardians_per_host_option(daemon: bool = True) -> Callable[[F], F]:
    """`--guardians-per-host N`, the one definition `rhizomed` and `rhizome up` share.
    The daemon's reads `$RHIZOME_GUARDIANS_PER_HOST` too and defaults to
    DEFAULT_GUARDIANS_PER_HOST; `up`'s (daemon=False) defaults to None: the flag goes on
    to the daemon `up` starts only when given (that daemon inherits `up`'s environment,
    the variable included)."""
    return click.option(
        "--guardians-per-host",
        "guardians_per_host",
        type=GuardiansPerHost(),
        default=DEFAULT_GUARDIANS_PER_HOST if daemon else None,
        show_default=daemon,
        envvar=GUARDIANS_PER_HOST_ENV if daemon else None,
        help=GUARDIANS_PER_HOST_HELP,
    )


def _job_certificates(internal_tls: InternalTls, backend: str) -> Callable[[str], dict[str, str]]:
    """How the LCM issues a job's TDS certificate: short-lived (24 h) where the guardian
    can renew it in running learners (a backend whose `renews_tls`: local, docker,
    kubernetes), else as long as a daemon's, since a learner there would lose its log
    shipping when the first one expired."""
    from services.backends.api import BACKENDS
    from services.security.tls import CLIENT_DAYS

    if getattr(BACKENDS.get(backend), "renews_tls", False):
        return internal_tls.job_credentials
    return functools.partial(
        internal_tls.job_credentials, valid=datetime.timedelta(days=CLIENT_DAYS)
    )
