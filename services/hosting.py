"""The hosting contract between the daemon and the services it hosts.

Each service package has a `hosting.py` with `build(ctx: DaemonContext) -> Hosted`: it
registers its gRPC servicers on `ctx.server`, reaches other services through
`ctx.channel(name)`, shares stores through the factories below, and hands back its RPC
service names and background work. The daemon (`services/daemon.py`, the `rhizomed` CLI)
imports this module and the hosting modules; neither imports the daemon.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import click
import grpc

from services.config import PlatformConfig
from services.local_channel import LocalChannel, RecordingServer

if TYPE_CHECKING:
    from services.store.jobs import JobsRepository


@dataclass
class Hosted:
    """What a service builder hands back: RPC service names and background work."""

    service_names: list[str] = field(default_factory=list)
    start: Callable[[], None] | None = None
    stop: Callable[[], None] | None = None


@dataclass
class DaemonContext:
    config: PlatformConfig
    server: grpc.Server
    # Channels to the services, in this process or elsewhere (config.peers).
    channels: dict[str, grpc.Channel] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)

    def channel(self, service: str) -> grpc.Channel | None:
        """A channel to `service`: in-process dispatch when this daemon hosts it (see
        services/local_channel.py), a real channel to its peer address otherwise."""
        if service in self.channels:
            return self.channels[service]
        if service in self.config.services:
            real = grpc.insecure_channel(self.config.grpc_address)
            handlers = self.server.handlers if isinstance(self.server, RecordingServer) else {}
            self.channels[service] = LocalChannel(handlers, real)  # type: ignore[assignment]
            return self.channels[service]
        address = self.config.peers.get(service)
        if not address:
            return None
        self.channels[service] = grpc.insecure_channel(address)
        return self.channels[service]


# A service's `build` function: what the daemon calls to host it.
ServiceBuilder = Callable[[DaemonContext], Hosted]


def mongo_database(ctx: DaemonContext) -> Any:
    """One MongoDB connection per daemon, shared by the services it hosts."""
    if "db" not in ctx.shared:
        from services.store.mongo import connect

        if not ctx.config.mongodb_uri:
            raise click.UsageError("no MongoDB: pass --mongodb-uri or set RHIZOME_MONGODB_URI")
        ctx.shared["db"] = connect(ctx.config.mongodb_uri)
    return ctx.shared["db"]


def jobs_repository(ctx: DaemonContext) -> JobsRepository:
    """One jobs repository per daemon (indexes ensured once), shared by its services."""
    if "jobs" not in ctx.shared:
        from services.store.jobs import JobsRepository

        repo = JobsRepository(mongo_database(ctx))
        repo.ensure_indexes()
        ctx.shared["jobs"] = repo
    return cast("JobsRepository", ctx.shared["jobs"])
