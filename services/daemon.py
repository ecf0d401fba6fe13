"""`rhizomed`: host any set of the platform services in one process.

Each service package hosts itself through `build(ctx) -> Hosted` in its `hosting.py`
(the contract is `services/hosting.py`, which this module imports and the services
import; nothing imports this module back). The daemon builds the requested services
into one gRPC server (with health checking and reflection), starts their background
work (the API's REST gateway among it), and shuts everything down cleanly on SIGTERM.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import click
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from contract.registry import Registry
from services.config import ALL_SERVICES, PlatformConfig, split_address
from services.hosting import DaemonContext, Hosted, ServiceBuilder
from services.local_channel import RecordingServer

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


class Daemon:
    def __init__(self, config: PlatformConfig) -> None:
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
        from services.metrics import GrpcMetricsInterceptor
        from services.rpc_guard import MalformedRequestInterceptor

        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="grpc"),
            interceptors=[GrpcMetricsInterceptor(), MalformedRequestInterceptor()],
            options=[
                ("grpc.max_receive_message_length", 80 * 1024 * 1024),
                ("grpc.so_reuseport", 0),
            ],
        )
        self.ctx = DaemonContext(config, RecordingServer(self.server))  # type: ignore[arg-type]
        self.hosted: list[Hosted] = []
        self.health = health.HealthServicer()
        self.port = 0
        self.metrics_server: Any = None

    def start(self) -> None:
        for name in self.config.services:
            self.hosted.append(builder(name)(self.ctx))
        names = [n for h in self.hosted for n in h.service_names]
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = self.server.add_insecure_port(self.config.grpc_address)
        if not self.port:
            raise RuntimeError(f"cannot listen on {self.config.grpc_address} (port in use?)")
        self.server.start()
        if self.config.metrics_address:
            from services.metrics import serve_metrics

            host, port = split_address(self.config.metrics_address)
            self.metrics_server = serve_metrics(port, host)
        for hosted in self.hosted:
            if hosted.start:
                hosted.start()
        for name in names:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    def stop(self) -> None:
        self.health.enter_graceful_shutdown()
        for hosted in reversed(self.hosted):
            if hosted.stop:
                with contextlib.suppress(Exception):
                    hosted.stop()
        self.server.stop(grace=2).wait(5)
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
    help="Address of a service hosted by another process (repeatable).",
)
@click.option(
    "--cluster-config",
    envvar="RHIZOME_CLUSTER_CONFIG",
    default="",
    help="Cluster description for the scheduler (YAML).",
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
    mongodb_uri: str,
    etcd_url: str,
    elasticsearch_url: str,
    data_dir: Path,
    peers: tuple[str, ...],
    cluster_config: str,
    quota_config: str,
    insecure_trust_user_header: bool,
    auth_cache_seconds: float,
    admin_token_file: Path | None,
    backend: str,
    docker_host: str,
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
        peers=_peers(peers),
        cluster_config=cluster_config,
        quota_config=quota_config,
        trust_user_header=insecure_trust_user_header,
        auth_cache_s=auth_cache_seconds,
        admin_token_file=str(admin_token_file.expanduser()) if admin_token_file else "",
        backend=backend,
    )
    from services.backends.api import backend_names

    if backend not in backend_names():
        raise click.BadParameter(
            f"{backend!r}; choose from {', '.join(backend_names())}", param_hint="--backend"
        )
    if docker_host:
        # The LCM's backend and every guardian it starts (they inherit it) use this engine.
        os.environ["DOCKER_HOST"] = docker_host
    config.data_dir.mkdir(parents=True, exist_ok=True)
    daemon = Daemon(config)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        daemon.start()
    except Exception as exc:  # a clear one-line reason, not a traceback
        log.debug("start failed", exc_info=True)
        click.echo(f"rhizomed: cannot start: {exc}", err=True)
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
                    "metrics_port": daemon.metrics_server.port if daemon.metrics_server else 0,
                    "services": list(config.services),
                }
            )
        )
        tmp.replace(state_file)
    log.info(
        "serving %s on %s (REST %s, metrics port %s)",
        ",".join(config.services),
        grpc_address,
        rest_address,
        daemon.metrics_server.port if daemon.metrics_server else "off",
    )
    stop.wait()
    log.info("shutting down")
    daemon.stop()


if __name__ == "__main__":
    main()
