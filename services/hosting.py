"""The hosting contract between the daemon and the services it hosts.

Each service package has a `hosting.py` with `build(ctx: DaemonContext) -> Hosted`: it
registers its gRPC servicers on `ctx.server`, reaches other services through
`ctx.channel(name)`, shares stores through the factories below, and hands back its RPC
service names and background work. The daemon (`services/daemon.py`, the `rhizomed` CLI)
imports this module and the hosting modules; neither imports the daemon.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import click
import grpc

from contract.credentials import internal_channel, with_bearer
from services.config import PlatformConfig
from services.local_channel import LocalChannel, RecordingServer

if TYPE_CHECKING:
    from services.security.api import ServiceCredentials
    from services.security.tls import InternalTls
    from services.store.jobs import JobsRepository

# The only service the public port serves (with health and reflection); every other
# service registers on the internal port (docs/security.md).
PUBLIC_SERVICES = frozenset({"rhizome.v1.Trainer"})


class SplitServer(RecordingServer):
    """What services register on: the public service goes to the public server, the
    internal ones to the internal server, and every handler is remembered for
    LocalChannel's in-process dispatch."""

    def __init__(self, public: grpc.Server, internal: grpc.Server) -> None:
        super().__init__(public)
        self.internal = internal

    def _target(self, service: str) -> grpc.Server:
        return self._server if service in PUBLIC_SERVICES else self.internal

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        with self._lock:
            for name, handler in handlers.items():
                self.handlers[f"/{service}/{name}"] = handler
        self._target(service).add_registered_method_handlers(service, handlers)

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        for handler in handlers:
            name = handler.service_name() if hasattr(handler, "service_name") else ""
            self._target(name).add_generic_rpc_handlers((handler,))


@dataclass
class Hosted:
    """What a service builder hands back: RPC service names and background work."""

    service_names: list[str] = field(default_factory=list)
    start: Callable[[], None] | None = None
    stop: Callable[[], None] | None = None
    # The work only the daemon holding leadership does (placing jobs, running guardians,
    # delivering webhooks): called after `start`, at once on a daemon that leads from the
    # start, at takeover on a hot standby (`rhizomed --standby`, docs/high-availability.md).
    # It must re-read whatever the previous leader may have changed since `build`.
    lead: Callable[[], None] | None = None
    # Started after `start` and after the daemon leads (a hot standby: while it waits
    # warm): what serves no gRPC call, so that a restarted daemon's API and leader work
    # do not wait for it. The REST gateway: FastAPI's import and app took ~0.35 s here.
    start_late: Callable[[], None] | None = None


# The services whose background work only one daemon may do at a time: a daemon hosting
# any of them campaigns for leadership (services/leader) before it does that work.
LEADER_SERVICES = ("scheduler", "lcm")


@dataclass
class DaemonContext:
    config: PlatformConfig
    server: grpc.Server
    # Channels to the services, in this process or elsewhere (config.peers).
    channels: dict[str, grpc.Channel] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)
    # The internal port's credentials (services/security): sent on every call to another
    # service, and the issuer of job tokens. None only in unit tests without a daemon.
    credentials: ServiceCredentials | None = None
    # Mutual TLS on the internal ports (services/security/tls.py InternalTls): this
    # daemon's channels present its client certificate; None: plaintext.
    internal_tls: InternalTls | None = None
    # Set while this daemon leads (always, for a daemon without leader services): a hot
    # standby keeps it clear and its gated services refuse calls (services/leader/gate.py).
    leading: threading.Event = field(default_factory=threading.Event)

    def _internal_channel(self, address: str) -> grpc.Channel:
        token = self.credentials.service_token() if self.credentials else ""
        tls = self.internal_tls.channel_credentials() if self.internal_tls else None
        return with_bearer(internal_channel(address, tls), token)

    def channel(self, service: str) -> grpc.Channel | None:
        """A channel to `service`: in-process dispatch when this daemon hosts it (see
        services/local_channel.py), a real channel to its peer's internal port otherwise;
        both carry the service credential."""
        if service in self.channels:
            return self.channels[service]
        if service in self.config.services:
            real = self._internal_channel(self.config.internal_address)
            handlers = self.server.handlers if isinstance(self.server, RecordingServer) else {}
            self.channels[service] = LocalChannel(handlers, real)  # type: ignore[assignment]
            return self.channels[service]
        address = self.config.peers.get(service)
        if not address:
            return None
        self.channels[service] = self._internal_channel(address)
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
        from services.store.job_secrets import JobSecrets
        from services.store.jobs import JobsRepository

        # A submit's data-store credentials go to the data directory, not the record.
        repo = JobsRepository(
            mongo_database(ctx), secrets=JobSecrets.in_data_dir(ctx.config.data_dir)
        )
        repo.ensure_indexes()
        ctx.shared["jobs"] = repo
    return cast("JobsRepository", ctx.shared["jobs"])


# Calls whose answer nobody waits for, held until answered: grpc cancels a call whose
# future is garbage-collected ("Cancelled upon garbage collection!"), so a future dropped
# at once sent nothing to a service in another daemon.
_UNANSWERED: set[Any] = set()


def unanswered(future: Any) -> None:
    """Let a call (a `.future(...)`, on a real or a local channel) run to its answer."""
    _UNANSWERED.add(future)
    future.add_done_callback(_UNANSWERED.discard)
