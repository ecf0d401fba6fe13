"""`rhizomed`: host any set of the platform services in one process.

Each service package hosts itself through `build(ctx) -> Hosted` in its `hosting.py`
(the contract is `services/hosting.py`, which this module imports and the services
import; nothing imports this module back). The daemon builds the requested services
into one gRPC server (with health checking and reflection), starts their background
work (the API's REST gateway among it), and shuts everything down cleanly on SIGTERM.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import click
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from contract.procs import PortInUse, listen_failure
from contract.registry import Registry
from contract.status import ExitCode
from services.config import ALL_SERVICES, PlatformConfig, split_address
from services.hosting import (
    LEADER_SERVICES,
    PUBLIC_SERVICES,
    DaemonContext,
    Hosted,
    ServiceBuilder,
    SplitServer,
)
from services.lcm.hosting import guardians_per_host_option
from services.leader.gate import StandbyGate
from services.security.api import SecurityError

log = logging.getLogger("rhizomed")


# Each service hosts itself through a `build(ctx) -> Hosted` function in its own package,
# so adding a service never means editing the daemon's internals. Registered by module
# path (contract.registry), so a daemon imports only the services it hosts; listed in
# start order.
def hosting_module(name: str) -> str:
    """The module that hosts a registered service (`services.api.hosting`)."""
    return f"services.{name}.hosting"


SERVICES: Registry[ServiceBuilder] = Registry("service", ordered=True)
for _name in ("api", "scheduler", "lcm", "tds"):
    SERVICES.register(_name, f"{hosting_module(_name)}:build")


def available_services() -> list[str]:
    """The services whose hosting module exists in this build, in start order."""
    return [name for name in SERVICES.names() if importlib.util.find_spec(hosting_module(name))]


def builder(name: str) -> ServiceBuilder:
    return SERVICES.get(name)


# Where a daemon started with internal port 0 remembers the port it got (see _bind_internal).
INTERNAL_PORT_FILE = "internal.port"


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# While a hot standby waits, its health answers SERVING for this name only (and
# NOT_SERVING for ""), so a probe can tell a warm standby from a dead or an active daemon.
STANDBY_HEALTH_NAME = "rhizome.Standby"


class Daemon:
    def __init__(self, config: PlatformConfig, standby: bool = False) -> None:
        unknown = [s for s in config.services if s not in ALL_SERVICES]
        if unknown:
            raise click.UsageError(
                f"unknown service {', '.join(unknown)}; choose from {', '.join(ALL_SERVICES)}"
            )
        have = available_services()
        missing = [s for s in config.services if s not in have]
        if missing:
            raise click.UsageError(
                f"service {', '.join(missing)} is not part of this build yet; "
                f"available: {', '.join(have)}"
            )
        self.config = config
        self.standby = standby
        # start() replaces the configured address by the bound one; port 0 matters later.
        self.internal_port_configured = split_address(config.internal_address)[1]
        self.leadership: Any = None
        self.extra_servers: list[grpc.Server] = []
        self.lead_done = threading.Event()
        self.lead_failed: Exception | None = None
        leading = threading.Event()
        from services.metrics import GrpcMetricsInterceptor
        from services.rpc_guard import MalformedRequestInterceptor
        from services.security.internal import InternalAuthInterceptor, SharedSecretCredentials

        options = [
            ("grpc.max_receive_message_length", 80 * 1024 * 1024),
            ("grpc.so_reuseport", 0),
        ]
        # Two servers: the public port serves the Trainer API, health and reflection; the
        # internal port serves LifecycleManager, TrainingData and Scheduler to holders of
        # the service credential or a job token (docs/security.md).
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="grpc"),
            interceptors=[
                GrpcMetricsInterceptor(),
                MalformedRequestInterceptor(),
                StandbyGate(leading),
            ],
            options=options,
        )
        self.credentials = SharedSecretCredentials.from_file(config.internal_secret_path)
        self.internal_tls: Any = None
        if config.internal_tls_dir:
            from services.security.tls import InternalTls

            self.internal_tls = InternalTls.open(Path(config.internal_tls_dir))
        self.internal_interceptors = [
            GrpcMetricsInterceptor(),
            InternalAuthInterceptor(self.credentials),
            MalformedRequestInterceptor(),
            StandbyGate(leading),
        ]
        self.grpc_options = options
        self.internal_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="grpc-internal"),
            interceptors=self.internal_interceptors,
            options=options,
        )
        self.ctx = DaemonContext(
            config,
            SplitServer(self.server, self.internal_server),  # type: ignore[arg-type]
            credentials=self.credentials,
            internal_tls=self.internal_tls,
            leading=leading,
        )
        self.hosted: list[Hosted] = []
        self.health = health.HealthServicer()
        # grpc's health servicer starts out SERVING for "": `rhizome up` would return
        # (and the REST gateway be called) before the services are up.
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = 0
        self.internal_port = 0
        self.metrics_server: Any = None
        self.health_monitor: Any = None
        # The daemon as a whole ("") serves once it leads and its late starts ran, in
        # whichever order they come (see _serving_if_ready).
        self._late_started = False
        self._ready = threading.Lock()

    def start(self) -> None:
        # The internal port is bound first: services hand its address to their learners
        # (the TDS) while they are built, and port 0 means any free port.
        self.internal_port = self._bind_internal()
        host, _ = split_address(self.config.internal_address)
        self.config.internal_address = f"{host}:{self.internal_port}"
        if not _is_loopback(host) and self.internal_tls is None:
            log.warning(
                "the internal port %s is not on loopback: its calls travel in clear text; keep "
                "it on a private network",
                self.config.internal_address,
            )
        for name in self.config.services:
            self.hosted.append(builder(name)(self.ctx))
        names = [n for h in self.hosted for n in h.service_names]
        public = [n for n in names if n in PUBLIC_SERVICES]
        internal = [n for n in names if n not in PUBLIC_SERVICES]
        for server, served in ((self.server, public), (self.internal_server, internal)):
            health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
            reflection.enable_server_reflection(
                [*served, health.SERVICE_NAME, reflection.SERVICE_NAME], server
            )
        try:
            self.port = self._bind_public()
        except RuntimeError:  # grpcio raises where older releases returned 0
            self.port = 0
        if not self.port:
            raise listen_failure("the API (--grpc-address)", self.config.grpc_address)
        self.internal_server.start()
        self.server.start()
        if self.config.metrics_address:
            from services.metrics import serve_metrics

            host, port = split_address(self.config.metrics_address)
            try:
                self.metrics_server = serve_metrics(port, host)
            except OSError as exc:
                raise listen_failure(
                    "the metrics endpoint (--metrics-address)", self.config.metrics_address
                ) from exc
        for hosted in self.hosted:
            if hosted.start:
                hosted.start()
        self.served_names = names
        contested = sorted(s for s in self.config.services if s in LEADER_SERVICES)
        if self.standby and not (contested and self.config.etcd_url):
            raise click.UsageError(
                "--standby needs etcd (--etcd URL) and a service only one daemon may run "
                f"(one of {', '.join(LEADER_SERVICES)}): the standby waits on a leader key there"
            )
        if not contested or not self.config.etcd_url:
            # Nothing to contend for, or no etcd to contend in (a scheduler without etcd):
            # this daemon is the only one of its kind.
            self._lead()
            self._start_late()
            return
        # Every service is built and serving-ready now (a hot standby is this far, warm);
        # the leader's work starts when this daemon holds the role (services/leader).
        from contract.etcd import EtcdClient
        from services.leader.etcd import EtcdLeadership
        from services.store.mongo import database_name

        self.health.set(STANDBY_HEALTH_NAME, health_pb2.HealthCheckResponse.SERVING)
        # One role per platform (its MongoDB database) and set of contested services, so
        # daemons that split the services between them do not contend with each other.
        role = f"daemon/{database_name(self.config.mongodb_uri)}/{'+'.join(contested)}"
        self.leadership = EtcdLeadership(
            EtcdClient.connect(self.config.etcd_url),
            role,
            ttl_s=self.config.leader_lease_ttl_s,
            info={
                "grpc": self.config.grpc_address,
                "rest": self.config.rest_address,
                "internal": self.config.internal_address,
            },
        )
        self.leadership.campaign(self._take_over, self._deposed)
        if not self.standby:
            # Normally the role is free (or its holder dead on this machine) and taken at
            # once; a daemon that finds another leading waits on (main), as its standby.
            self.lead_done.wait(self.leadership.ttl_s + 1.0)
            if self.lead_failed is not None:
                raise RuntimeError(f"taking the lead failed: {self.lead_failed}")
        self._start_late()

    def _start_late(self) -> None:
        """What need not delay the gRPC services and the leader's work (`Hosted.start_late`:
        the REST gateway), started after them: a daemon restarted after a crash serves its
        API and leads that much sooner. A hot standby runs these while it waits warm."""
        for hosted in self.hosted:
            if hosted.start_late:
                hosted.start_late()
        self._late_started = True
        self._serving_if_ready()

    def _serving_if_ready(self) -> None:
        """Once the daemon leads and its late starts ran, whichever comes last: the daemon
        as a whole ("") turns SERVING, so `rhizome up` returns with every port listening,
        and the store monitor (which sets "" too) starts."""
        with self._ready:
            ready = self.ctx.leading.is_set() and self._late_started
            if not ready or self.health_monitor is not None:
                return
            self.health.set("", health_pb2.HealthCheckResponse.SERVING)
            from services.health import start_health_monitor  # NOT_SERVING while a store is down

            self.health_monitor = start_health_monitor(self.ctx, self.health, self.served_names)

    def _lead(self) -> None:
        """Start the leader's work of every service, then serve everything."""
        if "jobs" in self.ctx.shared:  # a service of this daemon keeps job records
            # Records written before credentials moved out of them (issue #15), once per
            # start, by the leader. In the background: it reads every record, which must
            # not delay serving, and a guardian reading a record meanwhile finds either
            # its inline values or the file (written before the record), both usable.
            threading.Thread(
                target=self._migrate_inline_credentials, name="secrets-migration", daemon=True
            ).start()
        for hosted in self.hosted:
            if hosted.lead:
                hosted.lead()
        self.ctx.leading.set()
        for name in self.served_names:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._serving_if_ready()

    def _migrate_inline_credentials(self) -> None:
        from services.store.job_secrets import JobSecrets

        secrets = JobSecrets.in_data_dir(self.config.data_dir)
        try:
            migrated = secrets.migrate_inline(self.ctx.shared["jobs"])
        except Exception as exc:  # the store away: the next start tries again
            log.warning("could not move old job records' inline credentials out: %s", exc)
            return
        if migrated:
            log.warning(
                "moved the inline data-store credentials of %d job record(s) written by an "
                "older version out of MongoDB (into %s): %s",
                len(migrated),
                secrets.root,
                ", ".join(migrated),
            )

    def _take_over(self) -> None:
        started = time.monotonic()
        try:
            self._lead()
            # After the services serve: binding the old port may wait for the dead leader.
            self._adopt_internal_port()
        except Exception as exc:
            self.lead_failed = exc
            log.exception("taking the lead failed")
            if self.standby:
                # Half-led is worse than not at all: exit, and the supervisor's restart
                # (or another standby) takes the role.
                os._exit(ExitCode.FAILED)
            return
        finally:
            self.lead_done.set()
        self.health.set(STANDBY_HEALTH_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info(
            "leading (term %d): serving %s, %.0f ms after winning the election",
            self.leadership.token(),
            ",".join(self.config.services),
            (time.monotonic() - started) * 1000,
        )

    def _deposed(self) -> None:
        """The role was lost (the lease expired while this daemon could not refresh it): a
        contender may lead already, so this daemon must not act one moment longer. It
        exits without stopping the guardians: the new leader re-adopts them."""
        log.error("lost leadership; exiting so that only the new leader acts")
        os._exit(ExitCode.EVICTED)

    def _adopt_internal_port(self) -> None:
        """Running learners ship logs to the internal address they were given at deploy,
        the previous leader's: a standby on the same data directory serves that port too
        once the previous leader is gone (port 0 remembers it in INTERNAL_PORT_FILE)."""
        if self.internal_port_configured != 0:
            return  # an explicit internal address: learners were given that one
        remembered = self.config.data_dir / INTERNAL_PORT_FILE
        try:
            previous = int(remembered.read_text())
        except (OSError, ValueError):
            return
        if previous in (0, self.internal_port):
            return
        host, _ = split_address(self.config.internal_address)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="grpc-adopted"),
            interceptors=self.internal_interceptors,
            options=self.grpc_options,
        )
        recorded = getattr(self.ctx.server, "handlers", {})
        by_service: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
        for path, handler in recorded.items():
            service, _, method = path.strip("/").partition("/")
            if service not in PUBLIC_SERVICES:
                by_service.setdefault(service, {})[method] = handler
        for service, methods in by_service.items():
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler(service, methods),)
            )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        credentials = self.internal_tls.server_credentials() if self.internal_tls else None
        at = f"{host}:{previous}"
        why = ""
        # The dead leader's main thread shows as gone (a zombie) while its other threads
        # are still exiting and its sockets still open: try for a moment.
        deadline = time.monotonic() + 2.0
        bound = 0
        while not bound and time.monotonic() < deadline:
            try:
                bound = (
                    server.add_insecure_port(at)
                    if credentials is None
                    else server.add_secure_port(at, credentials)
                )
            except RuntimeError as exc:
                why = str(exc)
            if not bound:
                time.sleep(0.02)
        if not bound:
            log.warning(
                "could not serve the previous leader's internal port %d (%s); its running "
                "learners cannot ship logs until they are restarted",
                previous,
                why or "in use",
            )
            return
        server.start()
        self.extra_servers.append(server)
        log.info("serving the previous leader's internal port %d too", previous)

    def _bind_internal(self) -> int:
        """The internal port. Port 0 reuses the port of this data directory's previous
        daemon when it is free: running learners keep the TDS address they were given
        at deploy, so a restarted daemon must answer there."""
        address = self.config.internal_address
        host, port = split_address(address)
        remembered = self.config.data_dir / INTERNAL_PORT_FILE
        bound = 0
        # Mutual TLS when configured: the handshake refuses a caller without a certificate
        # of the platform's CA before any credential or request is read.
        credentials = self.internal_tls.server_credentials() if self.internal_tls else None

        def add(at: str) -> int:
            if credentials is None:
                return int(self.internal_server.add_insecure_port(at))
            return int(self.internal_server.add_secure_port(at, credentials))

        if port == 0:
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                bound = add(f"{host}:{int(remembered.read_text())}")
        if not bound:
            try:
                bound = add(address)
            except RuntimeError:
                bound = 0
        if not bound:
            raise listen_failure("the internal port (--internal-address)", address)
        if port == 0 and not self.standby:
            # A standby leaves the active daemon's port remembered: it adopts it at takeover.
            with contextlib.suppress(OSError):
                remembered.write_text(f"{bound}\n")
        return int(bound)

    def _bind_public(self) -> int:
        """The public port: TLS with the configured certificate, else plaintext."""
        if not self.config.tls_cert:
            return int(self.server.add_insecure_port(self.config.grpc_address))
        from services.security.tls import TlsFiles

        cert, key = TlsFiles(Path(self.config.tls_cert), Path(self.config.tls_key)).load()
        credentials = grpc.ssl_server_credentials([(key, cert)])
        return int(self.server.add_secure_port(self.config.grpc_address, credentials))

    def stop(self) -> None:
        if self.health_monitor is not None:
            self.health_monitor.stop()
        self.health.enter_graceful_shutdown()
        for hosted in reversed(self.hosted):
            if hosted.stop:
                with contextlib.suppress(Exception):
                    hosted.stop()
        if self.leadership is not None:
            self.leadership.resign()  # after the services: a standby takes over at once
        stopped = [
            self.server.stop(grace=2),
            self.internal_server.stop(grace=2),
            *(server.stop(grace=2) for server in self.extra_servers),
        ]
        for event in stopped:
            event.wait(5)
        if self.metrics_server is not None:
            self.metrics_server.stop()
        for channel in self.ctx.channels.values():
            channel.close()


def _peers(values: tuple[str, ...]) -> dict[str, str]:
    peers = {}
    for item in values:
        name, _, address = item.partition("=")
        if name not in ALL_SERVICES or not address:
            raise click.BadParameter(
                f"{item!r}: expected SERVICE=HOST:PORT, SERVICE in {ALL_SERVICES}"
            )
        peers[name] = address
    return peers


def _export_object_store(config: PlatformConfig) -> None:
    """The guardians (child processes) and their backends read the object store from the
    environment, as they read DOCKER_HOST. A remote store needs a backend that hands
    learners its credentials; the local backend reads the archive as a file."""
    if config.object_store.startswith("s3://") and config.backend == "local":
        raise click.BadParameter(
            f"{config.object_store!r} needs a backend whose learners fetch from it "
            "(--backend docker); the local backend reads code from a volume path",
            param_hint="--object-store",
        )
    os.environ["RHIZOME_OBJECT_STORE"] = config.object_store or str(config.objects_dir)
    os.environ["RHIZOME_OBJECT_STORE_ENDPOINT"] = config.object_store_endpoint
    os.environ["RHIZOME_STORAGE_GRANT_TTL_S"] = str(config.storage_grant_ttl_s)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--services",
    default="",
    envvar="RHIZOME_SERVICES",
    help="Comma-separated services to host in this process (default: all in this build).",
)
@click.option(
    "--grpc-address",
    default="127.0.0.1:50051",
    show_default=True,
    envvar="RHIZOME_GRPC_ADDRESS",
    help="Where the gRPC server listens.",
)
@click.option(
    "--rest-address",
    default="127.0.0.1:8080",
    show_default=True,
    envvar="RHIZOME_REST_ADDRESS",
    help="Where the REST gateway listens (with the api).",
)
@click.option(
    "--metrics-address",
    default="127.0.0.1:0",
    show_default=True,
    envvar="RHIZOME_METRICS_ADDRESS",
    help="Where Prometheus /metrics is served (port 0: any free port; empty: off).",
)
@click.option(
    "--internal-address",
    default="127.0.0.1:0",
    show_default=True,
    envvar="RHIZOME_INTERNAL_ADDRESS",
    help="Where the internal services (lcm, tds, scheduler) listen for the platform's own "
    "processes and learners (port 0: any free port). Keep it on loopback or a private network.",
)
@click.option(
    "--learner-tds-address",
    default="",
    envvar="RHIZOME_LEARNER_TDS_ADDRESS",
    help="The training data service's address as learners reach it, when that is not "
    "--internal-address (a Kubernetes Service in front of the internal port; default: the "
    "internal address).",
)
@click.option(
    "--internal-secret-file",
    type=click.Path(path_type=Path),
    default=None,
    envvar="RHIZOME_INTERNAL_SECRET_FILE",
    help="The service credential of the internal port (default <data dir>/internal.secret, "
    "generated 0600 on first start); daemons that are each other's --peer share it.",
)
@click.option(
    "--internal-tls-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    envvar="RHIZOME_INTERNAL_TLS_DIR",
    help="Serve the internal port over mutual TLS with the CA in this directory (made when "
    "missing): every caller, peers and learners included, must present a certificate of "
    "that CA. Daemons that are each other's --peer share it. Default: plaintext.",
)
@click.option(
    "--tls-cert",
    type=click.Path(path_type=Path),
    default=None,
    envvar="RHIZOME_TLS_CERT",
    help="Serve the public gRPC port and REST over TLS with this PEM certificate (chain); "
    "needs --tls-key. `rhizome up` passes the platform's own unless --insecure-plaintext.",
)
@click.option(
    "--tls-key",
    type=click.Path(path_type=Path),
    default=None,
    envvar="RHIZOME_TLS_KEY",
    help="The unencrypted PEM private key of --tls-cert.",
)
@click.option("--mongodb-uri", envvar="RHIZOME_MONGODB_URI", default="", help="MongoDB URI.")
@click.option("--etcd", "etcd_url", envvar="RHIZOME_ETCD", default="", help="etcd client URL.")
@click.option(
    "--elasticsearch-url", envvar="RHIZOME_ELASTICSEARCH_URL", default="", help="Elasticsearch URL."
)
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path),
    envvar="RHIZOME_DATA_DIR",
    default=str(PlatformConfig().data_dir),
    show_default=True,
    help="Object store, job directories and state files.",
)
@click.option(
    "--peer",
    "peers",
    multiple=True,
    metavar="SERVICE=HOST:PORT",
    help="The internal address (--internal-address) of a service hosted by another process "
    "(repeatable); both share --internal-secret-file.",
)
@click.option(
    "--cluster-config",
    envvar="RHIZOME_CLUSTER_CONFIG",
    default="",
    help="Cluster description for the scheduler (YAML) with the local and docker backends; "
    "with --backend kubernetes the scheduler reads the cluster's Nodes instead (refused here).",
)
@click.option(
    "--quota-config",
    envvar="RHIZOME_QUOTA_CONFIG",
    default="",
    help="Per-user, per-GPU-type quotas and limits for the scheduler (YAML; docs/scheduler.md). "
    "Default: no quotas.",
)
@click.option(
    "--insecure-trust-user-header",
    is_flag=True,
    help="FfDL compatibility: a call without a token is whoever its x-rhizome-user / "
    "X-Rhizome-User header says. Anyone who reaches the port can then act as anyone; off "
    "by default, and a warning is logged when on.",
)
@click.option(
    "--auth-cache-seconds",
    type=click.FloatRange(0, 3600),
    default=5.0,
    show_default=True,
    envvar="RHIZOME_AUTH_CACHE_S",
    help="How long a valid token lookup is reused: a token revoked through another daemon "
    "stops working here within this bound.",
)
@click.option(
    "--max-submits-in-flight",
    type=click.IntRange(1, 4096),
    default=24,
    show_default=True,
    envvar="RHIZOME_MAX_SUBMITS_IN_FLIGHT",
    help="Submits handled at once; beyond it a submit is refused at once with "
    "RESOURCE_EXHAUSTED / HTTP 429 and a retry-after, and nothing is stored.",
)
@click.option(
    "--admin-token-file",
    type=click.Path(path_type=Path),
    default=None,
    envvar="RHIZOME_ADMIN_TOKEN_FILE",
    help="Create an admin token and write it here (mode 0600) when the file is missing "
    "(`rhizome up` passes <data dir>/admin.token).",
)
@click.option(
    "--backend",
    envvar="RHIZOME_BACKEND",
    default="local",
    show_default=True,
    help="Where learners run: local (processes), docker (containers; docs/backends.md) or "
    "kubernetes (pods placed by our gang scheduler; RHIZOME_K8S_* settings, docs/kubernetes.md).",
)
@click.option(
    "--docker-host",
    envvar="DOCKER_HOST",
    default="",
    help="The Docker engine of the docker backend (default: DOCKER_HOST, else the local socket).",
)
@click.option(
    "--object-store",
    envvar="RHIZOME_OBJECT_STORE",
    default="",
    help="Where code archives, results and (S3) checkpoints live: a shared-volume path "
    "(default DATA_DIR/objects) or s3://BUCKET[/PREFIX]; learners get job-scoped, "
    "expiring credentials for S3 (docs/backends.md).",
)
@click.option(
    "--object-store-endpoint",
    envvar="RHIZOME_OBJECT_STORE_ENDPOINT",
    default="",
    help="The S3-compatible server's URL for an s3:// object store; the daemon's own "
    "credentials come from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY.",
)
@click.option(
    "--storage-grant-ttl",
    envvar="RHIZOME_STORAGE_GRANT_TTL_S",
    type=float,
    default=12 * 3600,
    show_default=True,
    help="Seconds a job's object-store credentials last (S3: 900 to 43200).",
)
@guardians_per_host_option()
@click.option(
    "--standby",
    is_flag=True,
    help="Run as a hot standby of the daemon that leads this platform: every service is "
    "built and its ports bound, but the API refuses calls (UNAVAILABLE / 503) until the "
    "active daemon dies; then this one takes over within the etcd lease (within "
    "milliseconds on the same machine) and re-adopts the running jobs' guardians "
    "(docs/high-availability.md). Without it, a daemon that finds another leading waits "
    "to take over before it reports ready.",
)
@click.option(
    "--leader-lease-ttl",
    "leader_lease_ttl",
    type=click.IntRange(2, 60),
    default=PlatformConfig().leader_lease_ttl_s,
    show_default=True,
    envvar="RHIZOME_LEADER_LEASE_TTL_S",
    help="Seconds of the etcd lease behind this daemon's leadership. A leader that cannot "
    "refresh it for 0.8 of it exits so that only one daemon acts; a standby on another "
    "machine takes over after it. Raise it where etcd or the daemon can be starved of CPU "
    "for seconds (docs/control-plane-scale.md); a standby on the same machine takes over "
    "at once either way.",
)
@click.option(
    "--state-file",
    type=click.Path(path_type=Path),
    default=None,
    help="Write the bound addresses and pid here as JSON once serving.",
)
def main(
    services: str,
    grpc_address: str,
    rest_address: str,
    metrics_address: str,
    internal_address: str,
    learner_tds_address: str,
    internal_secret_file: Path | None,
    internal_tls_dir: Path | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    mongodb_uri: str,
    etcd_url: str,
    elasticsearch_url: str,
    data_dir: Path,
    peers: tuple[str, ...],
    cluster_config: str,
    quota_config: str,
    insecure_trust_user_header: bool,
    auth_cache_seconds: float,
    max_submits_in_flight: int,
    admin_token_file: Path | None,
    backend: str,
    docker_host: str,
    object_store: str,
    object_store_endpoint: str,
    storage_grant_ttl: float,
    guardians_per_host: int,
    standby: bool,
    leader_lease_ttl: int,
    state_file: Path | None,
) -> None:
    """Run Rhizome platform services (api, scheduler, lcm, tds) in one process."""
    logging.basicConfig(
        level=os.environ.get("RHIZOME_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # One line per Elasticsearch request drowns the daemon's own log.
    logging.getLogger("elastic_transport").setLevel(logging.WARNING)
    from services.api.auth import install_log_redaction

    install_log_redaction()  # no token secret in any log line
    config = PlatformConfig(
        data_dir=data_dir.expanduser(),
        mongodb_uri=mongodb_uri,
        etcd_url=etcd_url,
        elasticsearch_url=elasticsearch_url,
        services=tuple(s.strip() for s in services.split(",") if s.strip())
        or tuple(available_services()),
        grpc_address=grpc_address,
        rest_address=rest_address,
        metrics_address=metrics_address,
        internal_address=internal_address,
        learner_tds_address=learner_tds_address,
        internal_secret_file=str(internal_secret_file.expanduser()) if internal_secret_file else "",
        internal_tls_dir=str(internal_tls_dir.expanduser()) if internal_tls_dir else "",
        tls_cert=str(tls_cert.expanduser()) if tls_cert else "",
        tls_key=str(tls_key.expanduser()) if tls_key else "",
        peers=_peers(peers),
        cluster_config=cluster_config,
        quota_config=quota_config,
        trust_user_header=insecure_trust_user_header,
        auth_cache_s=auth_cache_seconds,
        max_submits_in_flight=max_submits_in_flight,
        admin_token_file=str(admin_token_file.expanduser()) if admin_token_file else "",
        backend=backend,
        object_store=object_store,
        object_store_endpoint=object_store_endpoint,
        storage_grant_ttl_s=storage_grant_ttl,
        guardians_per_host=guardians_per_host,
        leader_lease_ttl_s=leader_lease_ttl,
    )
    if bool(tls_cert) != bool(tls_key):
        raise click.UsageError("--tls-cert and --tls-key go together: pass both, or neither")
    from services.backends.api import backend_names

    if backend not in backend_names():
        raise click.BadParameter(
            f"{backend!r}; choose from {', '.join(backend_names())}", param_hint="--backend"
        )
    if docker_host:
        # The LCM's backend and every guardian it starts (they inherit it) use this engine.
        os.environ["DOCKER_HOST"] = docker_host
    _export_object_store(config)
    config.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        daemon = Daemon(config, standby=standby)
    except SecurityError as exc:
        click.echo(f"rhizomed: cannot start: {exc}", err=True)
        sys.exit(1)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        daemon.start()
    except PortInUse as exc:  # its own code: whoever picked the port can pick another
        click.echo(f"rhizomed: cannot start: {exc}", err=True)
        daemon.stop()
        sys.exit(ExitCode.PORT_IN_USE)
    except Exception as exc:  # a clear one-line reason, not a traceback
        log.debug("start failed", exc_info=True)
        click.echo(f"rhizomed: cannot start: {exc}", err=True)
        daemon.stop()
        sys.exit(1)
    if not standby and not daemon.ctx.leading.is_set():
        holder = daemon.leadership.holder() if daemon.leadership else None
        log.info(
            "another daemon leads this platform (%s); waiting to take over (pass --standby "
            "to report ready as its hot standby)",
            f"pid {holder.get('pid')} on {holder.get('host')}" if holder else "unknown",
        )
        while not daemon.lead_done.wait(0.2) and not stop.is_set():
            pass
        if daemon.lead_failed is not None:
            click.echo(f"rhizomed: cannot start: {daemon.lead_failed}", err=True)
            daemon.stop()
            sys.exit(1)
    if state_file:
        tmp = state_file.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "grpc": config.grpc_address,
                    "rest": config.rest_address,
                    "internal": config.internal_address,
                    "tls": bool(config.tls_cert),
                    "metrics_port": daemon.metrics_server.port if daemon.metrics_server else 0,
                    "services": list(config.services),
                    "standby": not daemon.ctx.leading.is_set(),
                }
            )
        )
        tmp.replace(state_file)
    log.info(
        "serving %s on %s (internal services %s, REST %s, metrics port %s)",
        ",".join(config.services),
        grpc_address,
        config.internal_address,
        rest_address,
        daemon.metrics_server.port if daemon.metrics_server else "off",
    )
    # What start-up built (modules, servers, the services' objects) lives as long as the
    # daemon: frozen out of the cyclic collector's sight, its full collections no longer
    # walk it (they were 3-5 % of the daemon's CPU on the submit path, issue #18). No
    # collection first: a full one here holds the GIL for tens of ms just as a restarted
    # daemon answers its first calls; the little garbage start-up left stays.
    gc.freeze()
    stop.wait()
    log.info("shutting down")
    daemon.stop()


if __name__ == "__main__":
    main()
