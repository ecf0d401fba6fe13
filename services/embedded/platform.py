"""`rhizome up --embedded` / `rhizome down`: the whole platform on one machine.

Starts real etcd, a MongoDB-wire server and an Elasticsearch-API server under a data
directory, waits until each is healthy, then starts `rhizomed`. The ports and pids are
kept in `<data_dir>/platform.json`, so `rhizome down` (another process) stops exactly
what `up` started, by pid, and a later `up` reuses the same ports and data.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contract.etcd import StoreUnavailable
from contract.procs import free_port, pid_alive, port_free, stop_process_group
from services.embedded.process import DependencyError, ManagedServer
from services.embedded.servers import (
    ElasticsearchServer,
    EtcdServer,
    MongoServer,
    url_port,
    waking_its_listener,
)
from services.embedded.supervisor import LOG_FILE as SUPERVISOR_LOG
from services.embedded.supervisor import restart_recipe, state_lock
from services.security.etcd_auth import EtcdAuthFiles, EtcdAuthSetupError, ensure_etcd_auth

STATE_FILE = "platform.json"
Progress = Callable[[str], None]


def _pick(port: int | None) -> int:
    """Reuse a remembered or default port when it is free; 0/None means any free port."""
    if port and port_free(port):
        return port
    return free_port()


def port_holder(port: int) -> str:
    """Who listens on 127.0.0.1/any `port`: 'pid N (command line)', or a plain
    'another process' when the system does not say (another user's process)."""
    import psutil

    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return "another process"
    for conn in conns:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            if not conn.pid:
                break
            try:
                cmd = " ".join(psutil.Process(conn.pid).cmdline())[:120]
            except psutil.Error:
                cmd = ""
            return f"pid {conn.pid}" + (f" ({cmd})" if cmd else "")
    return "another process"


def choose_port(
    what: str, flag: str, explicit: int | None, remembered: int | None, default: int
) -> int:
    """The port for `what`: an explicit one (`flag N`) exactly, or an error saying who holds
    it; 0 any free port; none given: the one remembered from the last run, else `default`,
    else (taken) any free port."""
    if explicit is None:
        return _pick(remembered or default)
    if explicit == 0:
        return free_port()
    if not port_free(explicit):
        raise DependencyError(
            f"{flag} {explicit}: port {explicit} is in use by {port_holder(explicit)}; stop "
            f"that process, or choose another port ({flag} 0 picks any free one) for the {what}"
        )
    return explicit


class DaemonServer(ManagedServer):
    name = "rhizomed"

    def __init__(
        self,
        data_dir: Path,
        port: int,
        rest_port: int,
        args: list[str],
        tls: TlsChoice | None = None,
        environ: dict[str, str] | None = None,
        metrics_port: int | None = None,
    ) -> None:
        super().__init__(data_dir, port)
        self.rest_port = rest_port
        self.metrics_port = metrics_port  # None: as `args` say (off, or their own address)
        self.args = [*args, *(tls.daemon_args() if tls else [])]
        self.tls = tls
        self._environ = dict(environ or {})

    def listen_ports(self) -> list[int]:
        return [self.port, self.rest_port, *([self.metrics_port] if self.metrics_port else [])]

    def repick_ports(self) -> None:
        """Other free ports for the API, the REST gateway and the metrics endpoint: set
        `repick` only where all of them are the caller's own choice."""
        self.port, self.rest_port = free_port(), free_port()
        if self.metrics_port:
            self.metrics_port = free_port()

    def environ(self) -> dict[str, str]:
        return self._environ

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "services.daemon",
            f"--grpc-address=127.0.0.1:{self.port}",
            f"--rest-address=127.0.0.1:{self.rest_port}",
            f"--data-dir={self.data_dir}",
            *([f"--metrics-address=127.0.0.1:{self.metrics_port}"] if self.metrics_port else []),
            *self.args,
        ]

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        tls = self.tls is not None and self.tls.enabled
        return grpc_serving(self.url, tls=tls, ca=self.tls.ca_bytes() if tls and self.tls else None)


def grpc_serving(
    address: str, timeout_s: float = 0.5, tls: bool = False, ca: bytes | None = None
) -> bool:
    """Whether the daemon at `address` answers health checks as SERVING (over TLS,
    trusting `ca` or the system's CAs, when `tls`)."""
    if tls:
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca))
    else:
        channel = grpc.insecure_channel(address)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False
    finally:
        channel.close()


@dataclass
class TlsChoice:
    """How `up` serves the public ports: its own CA and certificate (the default),
    certificates of yours, or plaintext (`--insecure-plaintext`)."""

    plaintext: bool = False
    cert: str = ""  # yours: a PEM chain and its key; empty: generated in <data dir>/tls
    key: str = ""
    ca: str = ""  # the CA clients trust; empty with your own certificate: the system's
    # The platform's own CA directory (<data dir>/tls), whose certificates the internal
    # port requires (mutual TLS), whichever certificate the public ports serve.
    internal_dir: str = ""

    @property
    def enabled(self) -> bool:
        return not self.plaintext

    def prepare(self, data_dir: Path) -> TlsChoice:
        """The certificates to serve with, generated or checked now: a bad certificate
        stops `up` with the reason before anything starts."""
        if self.plaintext:
            return self
        from services.security.api import TlsError

        try:
            return self._prepare(data_dir)
        except TlsError as exc:
            raise DependencyError(str(exc)) from None

    def _prepare(self, data_dir: Path) -> TlsChoice:
        from services.security.tls import TLS_DIR, TlsFiles, ensure_local_certificates

        files = ensure_local_certificates(data_dir)
        internal_dir = str(Path(data_dir).resolve() / TLS_DIR)
        if not self.cert and not self.key:
            return TlsChoice(
                cert=str(files.cert),
                key=str(files.key),
                ca=str(files.ca),
                internal_dir=internal_dir,
            )
        if not (self.cert and self.key):
            raise DependencyError("--tls-cert and --tls-key go together: pass both, or neither")
        mine = TlsFiles(Path(self.cert), Path(self.key), Path(self.ca) if self.ca else None)
        mine.load()
        mine.ca_bytes()
        return TlsChoice(
            cert=str(Path(self.cert).resolve()),
            key=str(Path(self.key).resolve()),
            ca=str(Path(self.ca).resolve()) if self.ca else "",
            internal_dir=internal_dir,
        )

    def daemon_args(self) -> list[str]:
        if self.plaintext:
            return []
        args = [f"--tls-cert={self.cert}", f"--tls-key={self.key}"]
        return [*args, f"--internal-tls-dir={self.internal_dir}"] if self.internal_dir else args

    def ca_bytes(self) -> bytes | None:
        return Path(self.ca).read_bytes() if self.enabled and self.ca else None


@dataclass
class PlatformState:
    data_dir: str
    processes: dict[str, dict[str, Any]] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    # The supervisor's pid and log (services/embedded/supervisor.py); not a supervised part.
    supervisor: dict[str, Any] = field(default_factory=dict)
    # Whether the API serves TLS, and the CA the CLI and SDK trust for it ("" : the
    # system's); they use it when they talk to this platform (services/client/sdk.py).
    tls: bool = False
    tls_ca: str = ""

    @property
    def api_address(self) -> str:
        """The API's address; `ACTIVE,STANDBY` with a hot standby (`up --standby`), which
        the SDK and CLI go round on UNAVAILABLE."""
        addresses = [self.urls.get(k, "") for k in ("api", "api-standby")]
        return ",".join(a for a in addresses if a)

    @property
    def rest_url(self) -> str:
        return self.urls.get("rest", "")


class StaleStateError(DependencyError):
    """The data directory's platform.json is not this version's (or not readable): the
    message says which file and why, `fix` how to get going again."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(f"{message}; {fix}")
        self.fix = fix


def load_state(data_dir: Path) -> PlatformState | None:
    """The platform state of `data_dir`, None when there is none or it is unreadable
    (the supervisor's view; `read_state` says why)."""
    try:
        return read_state(data_dir)
    except StaleStateError:
        return None


def read_state(data_dir: Path) -> PlatformState | None:
    """The platform state of `data_dir`, None when none was written; StaleStateError
    when the file is not this version's (an older Rhizome's, or damaged)."""
    path = Path(data_dir) / STATE_FILE
    if not path.exists():
        return None
    fix = (
        f"stop what it started with the Rhizome that wrote it (`rhizome down`), or move "
        f"the data directory aside (`mv {data_dir} {data_dir}.old`) and run "
        "`rhizome up --embedded` again"
    )
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as exc:
        raise StaleStateError(f"{path} is not readable platform state ({exc})", fix) from None
    known = set(PlatformState.__dataclass_fields__)
    if not isinstance(raw, dict) or "data_dir" not in raw:
        raise StaleStateError(f"{path} is not platform state of this Rhizome version", fix)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise StaleStateError(
            f"{path} was written by another version of Rhizome (unknown fields: "
            f"{', '.join(unknown)})",
            fix,
        )
    bad = [
        k
        for k in ("processes", "urls", "ports", "supervisor")
        if not isinstance(raw.get(k, {}), dict)
    ]
    if bad:
        raise StaleStateError(
            f"{path} was written by another version of Rhizome ({', '.join(bad)} have "
            "another shape)",
            fix,
        )
    return PlatformState(**raw)


def save_state(state: PlatformState) -> None:
    path = Path(state.data_dir) / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state.__dict__, indent=2))
    tmp.replace(path)


def running(state: PlatformState) -> dict[str, bool]:
    return {name: pid_alive(int(p["pid"])) for name, p in state.processes.items()}


def up(
    data_dir: Path,
    grpc_port: int | None = None,
    rest_port: int | None = None,
    etcd_url: str = "",
    mongodb_uri: str = "",
    elasticsearch_url: str = "",
    services: str = "",
    progress: Progress = lambda _: None,
    backend: str = "local",
    tls: TlsChoice | None = None,
    standby: bool = False,
    daemon_args: Sequence[str] = (),
) -> PlatformState:
    """Start whatever of the platform is not running yet; return where everything is.
    `grpc_port`/`rest_port`: None reuses the ports of the last run (else 50051/8080, else
    any free one); a number is used exactly (0: any free port), or `up` fails saying who
    holds it. With the docker backend: an engine (DOCKER_HOST's, or our own dockerd under the data
    directory) and the learner image (built offline if the engine lacks it).
    `daemon_args`: more `rhizomed` flags (`up --guardians-per-host`), kept in its recipe."""
    data_dir = Path(data_dir).expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    previous = read_state(data_dir)
    state = PlatformState(str(data_dir))
    alive: dict[str, bool] = {}
    if previous:
        alive = running(previous)
        if alive and all(alive.values()):
            _check_ports_of_running(previous, grpc_port, rest_port)
            progress(f"already running (data in {data_dir})")
            ensure_supervisor(previous, progress)
            return previous
        state.ports = previous.ports
        # What is still alive from an earlier run (say, after the daemon crashed) is kept:
        # only the missing parts start, so a daemon restart does not restart the databases.
        for name, proc in previous.processes.items():
            if alive.get(name):
                state.processes[name] = proc
                state.urls[name] = previous.urls.get(name, "")
                progress(f"{name} is still running (pid {proc['pid']})")
    api_ports: tuple[int, int] | None = None
    if not alive.get("api"):  # chosen first: a busy explicit port stops `up` before anything
        gport = choose_port("API", "--grpc-port", grpc_port, state.ports.get("api"), 50051)
        rport = choose_port("REST gateway", "--rest-port", rest_port, state.ports.get("rest"), 8080)
        if rport == gport:
            if rest_port:
                raise DependencyError(
                    f"--grpc-port and --rest-port are both {gport}; give two ports"
                )
            rport = free_port()
        api_ports = (gport, rport)
    elif grpc_port is not None or rest_port is not None:
        assert previous is not None
        _check_ports_of_running(previous, grpc_port, rest_port)
    started: list[ManagedServer] = []

    def launch(key: str, server: ManagedServer, what: str, repick: bool = True) -> str:
        """Start `server`; `repick`: its ports are ours (remembered, default or free), so
        one taken before the server binds it is replaced by another free one."""
        server.repick = repick
        progress(f"starting {what} on 127.0.0.1:{server.port} ...")
        try:
            info = server.start()
        except DependencyError:
            for s in reversed(started):
                s.stop()
            save_state(PlatformState(str(data_dir), ports=state.ports))
            raise
        started.append(server)
        state.processes[key] = {
            "pid": info.pid,
            **restart_recipe(server.argv(), server.data_dir, Path(info.log_path), server.environ()),
        }
        state.ports[key] = server.port
        progress(f"{what} is healthy ({info.url}, log {info.log_path})")
        return info.url

    deps = data_dir / "deps"
    if backend == "docker":  # first: if there can be no engine, nothing else is started
        from services.embedded.docker_backend import ensure_engine

        state.urls["docker"] = ensure_engine(deps / "dockerd", state.processes, progress)
    if etcd_url:
        state.urls["etcd"] = etcd_url
    elif "etcd" not in state.processes:
        etcd = EtcdServer(
            deps / "etcd", _pick(state.ports.get("etcd")), _pick(state.ports.get("etcd-peer"))
        )
        state.urls["etcd"] = launch("etcd", etcd, "etcd")
        state.ports["etcd-peer"] = etcd.peer_port
    etcd_auth: EtcdAuthFiles | None = None
    if not etcd_url:  # our own etcd (a URL of yours keeps its own users: docs/security.md)
        try:
            etcd_auth = ensure_etcd_auth(data_dir, state.urls["etcd"])
        except (EtcdAuthSetupError, StoreUnavailable) as exc:
            for server in reversed(started):
                server.stop()
            save_state(PlatformState(str(data_dir), ports=state.ports))
            raise DependencyError(f"etcd authentication: {exc}") from exc
    if mongodb_uri:
        state.urls["mongodb"] = mongodb_uri
    elif "mongodb" not in state.processes:
        state.urls["mongodb"] = launch(
            "mongodb",
            MongoServer(deps / "mongodb", _pick(state.ports.get("mongodb"))),
            "MongoDB-wire server",
        )
    if elasticsearch_url:
        state.urls["elasticsearch"] = elasticsearch_url
    elif "elasticsearch" not in state.processes:
        state.urls["elasticsearch"] = launch(
            "elasticsearch",
            ElasticsearchServer(deps / "elasticsearch", _pick(state.ports.get("elasticsearch"))),
            "Elasticsearch-API server",
        )
    if "api" in state.processes and previous is not None:
        for key in ("rest", "metrics"):
            state.urls[key] = previous.urls.get(key, "")
        state.tls, state.tls_ca = previous.tls, previous.tls_ca
    else:
        serving = (tls or TlsChoice()).prepare(data_dir)
        assert api_ports is not None
        gport, rport = api_ports
        mport = _pick(state.ports.get("metrics"))
        args = [
            f"--admin-token-file={data_dir / 'admin.token'}",  # 0600; the CLI and SDK read it
        ]
        # The store URIs (a URL of yours may hold a password) and the etcd credential
        # files go in the daemon's environment, not its command line: any local user, a
        # learner uid included, can read /proc/PID/cmdline.
        environ = {
            "RHIZOME_MONGODB_URI": state.urls["mongodb"],
            "RHIZOME_ETCD": state.urls["etcd"],
            "RHIZOME_ELASTICSEARCH_URL": state.urls["elasticsearch"],
            **(etcd_auth.daemon_environ() if etcd_auth else {}),
        }
        if not services:
            from services.daemon import available_services

            services = ",".join(available_services())
        args.append(f"--services={services}")
        if backend != "local":
            args.append(f"--backend={backend}")
        if state.urls.get("docker"):
            args.append(f"--docker-host={state.urls['docker']}")
        args.extend(daemon_args)
        daemon = DaemonServer(data_dir, gport, rport, args, serving, environ, mport)
        # A port given with --grpc-port/--rest-port is the user's: never replaced.
        ours = not grpc_port and not rest_port
        state.urls["api"] = launch("api", daemon, f"rhizomed ({services})", repick=ours)
        state.ports["rest"] = rport = daemon.rest_port
        state.tls, state.tls_ca = serving.enabled, serving.ca
        state.urls["rest"] = f"{'https' if serving.enabled else 'http'}://127.0.0.1:{rport}"
        state.ports["metrics"] = mport = daemon.metrics_port or mport
        state.urls["metrics"] = f"http://127.0.0.1:{mport}/metrics"
        if standby:
            from services.embedded.standby import StandbyDaemonServer

            # The same platform and flags; its own ports (metrics: any free one).
            warm = StandbyDaemonServer(
                data_dir,
                _pick(state.ports.get("api-standby")),
                _pick(state.ports.get("rest-standby")),
                [*args, "--metrics-address=127.0.0.1:0"],
                serving,
                environ,  # the same stores, from its environment as the active one's
            )
            state.urls["api-standby"] = launch("api-standby", warm, "hot standby rhizomed")
            state.ports["rest-standby"] = warm.rest_port
    state.supervisor = (previous.supervisor if previous else {}) or {}
    ensure_supervisor(state, progress)
    return state


def _check_ports_of_running(
    previous: PlatformState, grpc_port: int | None, rest_port: int | None
) -> None:
    """A running daemon keeps its ports: asking for others is an error saying how to move it."""
    for flag, key, asked in (("--grpc-port", "api", grpc_port), ("--rest-port", "rest", rest_port)):
        now = previous.ports.get(key)
        if asked and now and asked != now:
            raise DependencyError(
                f"{flag} {asked}: the platform in {previous.data_dir} already runs with that "
                f"port at {now}; run `rhizome down` first to start it on {asked}"
            )


def ensure_supervisor(state: PlatformState, progress: Progress) -> None:
    """Start the supervisor of the platform's processes unless it runs; save the state."""
    data_dir = Path(state.data_dir)
    with state_lock(data_dir):
        pid = int(state.supervisor.get("pid") or 0)
        if not (pid and pid_alive(pid)):
            port = _pick(state.ports.get("supervisor-metrics"))
            log_path = data_dir / SUPERVISOR_LOG
            with open(log_path, "ab") as out:
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "services.embedded.supervisor",
                        f"--data-dir={data_dir}",
                        f"--metrics-address=127.0.0.1:{port}",
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            state.supervisor = {"pid": proc.pid, "log": str(log_path)}
            state.ports["supervisor-metrics"] = port
            state.urls["supervisor-metrics"] = f"http://127.0.0.1:{port}/metrics"
            progress(f"supervisor started (pid {proc.pid}): restarts whatever dies, log {log_path}")
        save_state(state)


def stop_supervisor(state: PlatformState, progress: Progress) -> None:
    """Stop the supervisor (by pid) before what it supervises, so it resurrects nothing."""
    pid = int(state.supervisor.get("pid") or 0)
    if pid and pid_alive(pid):
        progress(f"stopping the supervisor (pid {pid}) ...")
        stop_process_group(pid, timeout_s=15)
    state.supervisor = {}


def down(data_dir: Path, progress: Progress = lambda _: None) -> bool:
    """Stop everything `up` started (daemon first, so it stops its guardians cleanly)."""
    data_dir = Path(data_dir).expanduser().resolve()
    state = read_state(data_dir)
    if state is None:
        return False
    stop_supervisor(state, progress)
    with state_lock(data_dir):  # a restart the supervisor had under way is written by now
        state = load_state(data_dir) or state
        state.supervisor = {}
    # The standby first: stopped after the active daemon, it would take over for a moment.
    order = ["api-standby", "api", "dockerd", "elasticsearch", "mongodb", "etcd"]
    for name in sorted(state.processes, key=lambda n: order.index(n) if n in order else 0):
        pid = int(state.processes[name]["pid"])
        if name == "dockerd":
            from services.embedded.docker_backend import stop_engine

            stop_engine(state.processes[name], progress)
        elif pid_alive(pid):
            progress(f"stopping {name} (pid {pid}) ...")
            port = url_port(state.urls.get(name, "")) if name == "mongodb" else None
            # SecantusDB exits 2 s sooner once woken (servers.waking_its_listener)
            with waking_its_listener(port) if port else contextlib.nullcontext():
                stop_process_group(pid, timeout_s=15)
    state.processes = {}
    save_state(state)
    return True


def status(data_dir: Path) -> dict[str, Any]:
    data_dir = Path(data_dir).expanduser().resolve()
    state = read_state(data_dir)
    if state is None:
        return {"data_dir": str(data_dir), "running": False, "components": {}}
    alive = running(state)
    components = {
        name: {
            "pid": proc["pid"],
            "alive": alive[name],
            "log": proc["log"],
            "url": state.urls.get(name, ""),
        }
        for name, proc in state.processes.items()
    }
    with contextlib.suppress(Exception):
        if "api" in components:
            ca = Path(state.tls_ca).read_bytes() if state.tls and state.tls_ca else None
            components["api"]["serving"] = grpc_serving(state.urls["api"], tls=state.tls, ca=ca)
    for name, proc in state.processes.items():
        components[name]["restarts"] = int(proc.get("restarts", 0))
    supervisor: dict[str, Any] = {}
    if state.supervisor:
        pid = int(state.supervisor["pid"])
        supervisor = {
            "pid": pid,
            "alive": pid_alive(pid),
            "log": state.supervisor.get("log", ""),
            "url": state.urls.get("supervisor-metrics", ""),
        }
    return {
        "data_dir": str(data_dir),
        "running": bool(alive) and all(alive.values()),
        "components": components,
        "supervisor": supervisor,  # not a component: it restarts them
        "urls": state.urls,
    }
