"""rhizomed: refuses unknown services clearly and shuts down cleanly on SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from contract.procs import free_port
from contract.status import ExitCode
from services.daemon import Daemon
from services.embedded.platform import grpc_serving
from services.embedded.process import ManagedServer
from tests.ports import listening_on

DAEMON = [sys.executable, "-m", "services.daemon"]


def test_an_unknown_service_is_a_clear_usage_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*DAEMON, "--services", "api,frobnicator", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown service frobnicator" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_malformed_peer_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*DAEMON, "--services", "api", "--peer", "tds", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "SERVICE=HOST:PORT" in proc.stderr


def test_an_unreachable_mongodb_is_named(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            *DAEMON,
            "--services",
            "api",
            "--data-dir",
            str(tmp_path),
            "--mongodb-uri",
            f"mongodb://127.0.0.1:{free_port()}/?serverSelectionTimeoutMS=300",
            "--grpc-address",
            f"127.0.0.1:{free_port()}",
            "--rest-address",
            f"127.0.0.1:{free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "MongoDB at mongodb://127.0.0.1" in proc.stderr and "unreachable" in proc.stderr


@pytest.mark.integration
def test_sigterm_shuts_the_daemon_down_cleanly(tmp_path: Path, mongo_server: ManagedServer) -> None:
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [
            *DAEMON,
            "--services",
            "api",
            "--data-dir",
            str(tmp_path),
            "--mongodb-uri",
            mongo_server.url,
            "--grpc-address",
            address,
            "--rest-address",
            f"127.0.0.1:{free_port()}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not grpc_serving(address) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.1)
        assert grpc_serving(address)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert not grpc_serving(address)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _imports(path: Path) -> set[str]:
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_services_import_the_hosting_contract_never_the_daemon() -> None:
    """The daemon (the CLI) imports the hosting contract and the services' hosting
    modules; no service imports the daemon back."""
    import services
    from services import daemon, hosting

    root = Path(services.__file__).parent
    # The embedded platform launches `rhizomed` and asks it which services it has.
    allowed = {root / "daemon.py", root / "embedded" / "platform.py"}
    importers = [
        str(p.relative_to(root))
        for p in sorted(root.rglob("*.py"))
        if p not in allowed and "services.daemon" in _imports(p)
    ]
    assert importers == []
    assert "services.daemon" not in _imports(Path(hosting.__file__))
    for module in map(daemon.hosting_module, daemon.SERVICES.names()):
        path = root.parent / (module.replace(".", "/") + ".py")
        assert "services.hosting" in _imports(path), module


def test_learners_are_told_the_learner_tds_address_when_one_is_given(
    tmp_path: Path, mongo_server: ManagedServer, etcd_server: ManagedServer
) -> None:
    """On Kubernetes the internal port listens on the pod and learners reach it through a
    Service: the LCM hands guardians (and so learners) that address, not its own."""
    from services.config import PlatformConfig
    from services.daemon import Daemon

    def tds_address(**extra: Any) -> str:
        daemon = Daemon(
            PlatformConfig(
                data_dir=tmp_path / "data",
                mongodb_uri=mongo_server.url,
                etcd_url=etcd_server.url,
                services=("lcm",),
                peers={"tds": "10.0.0.5:50052"},  # the TDS hosted by another daemon
                grpc_address=f"127.0.0.1:{free_port()}",
                **extra,
            )
        )
        daemon.start()
        try:
            return str(daemon.ctx.shared["lcm"].config.tds_address)
        finally:
            daemon.stop()

    assert tds_address(learner_tds_address="rz-internal.rhizome.svc:50052") == (
        "rz-internal.rhizome.svc:50052"
    )
    assert tds_address() == "10.0.0.5:50052"  # default: where the TDS listens


@pytest.mark.integration
@pytest.mark.parametrize("listener", ["--grpc-address", "--rest-address", "--metrics-address"])
def test_a_port_in_use_exits_with_its_own_code_naming_the_listener(
    tmp_path: Path, mongo_server: ManagedServer, listener: str
) -> None:
    """Whoever picked the ports (`rhizome up`, ManagedServer.start) tells a taken port from
    any other failure by the exit code alone, and picks others."""
    addresses = {
        "--grpc-address": f"127.0.0.1:{free_port()}",
        "--rest-address": f"127.0.0.1:{free_port()}",
        "--metrics-address": f"127.0.0.1:{free_port()}",
    }
    with listening_on() as port:
        addresses[listener] = f"127.0.0.1:{port}"
        proc = subprocess.run(
            [
                *DAEMON,
                "--services",
                "api",
                "--data-dir",
                str(tmp_path),
                "--mongodb-uri",
                mongo_server.url,
                *(f"{flag}={address}" for flag, address in addresses.items()),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == ExitCode.PORT_IN_USE, proc.stderr
    assert f"could not listen on 127.0.0.1:{port}: the port is in use" in proc.stderr
    assert f"({listener}) could not listen" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.integration
def test_the_grpc_api_serves_while_the_rest_gateway_loads_and_the_daemon_is_healthy_after(
    tmp_path: Path, mongo_server: ManagedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The REST gateway is a late start (Hosted.start_late): a restarted daemon answers
    gRPC calls without waiting for FastAPI to load, while its overall health ("", what
    `rhizome up` waits for) stays NOT_SERVING until the gateway listens too."""
    from services.api import rest
    from services.client.sdk import Client, ClientError
    from services.store.mongo import connect
    from services.store.tokens import TokensRepository
    from tests.daemons import daemon_config

    loading, go_on = threading.Event(), threading.Event()
    real_build_app = rest.build_app

    def slow_build_app(*args: Any, **kwargs: Any) -> Any:
        loading.set()
        assert go_on.wait(30), "the test never let the gateway load"
        return real_build_app(*args, **kwargs)

    monkeypatch.setattr(rest, "build_app", slow_build_app)
    daemon = Daemon(daemon_config(tmp_path, mongo_server, services=("api",)))
    starting = threading.Thread(target=daemon.start, daemon=True)
    starting.start()
    try:
        assert loading.wait(30), "the REST gateway never started loading"
        token = (
            TokensRepository(connect(mongo_server.url))
            .create("u", "user", created_by="tests")
            .secret
        )
        with (
            Client(daemon.config.grpc_address, token=token, tls=False) as client,
            pytest.raises(ClientError) as raised,
        ):
            client.get_job("job-absent")
        # Answered by the Trainer itself (a gated daemon says it does not serve yet).
        assert raised.value.code == "NOT_FOUND", raised.value.message
        assert not grpc_serving(daemon.config.grpc_address)  # "" not yet
        go_on.set()
        starting.join(30)
        assert not starting.is_alive()
        assert grpc_serving(daemon.config.grpc_address)
        assert _rest_listens(daemon.config.rest_address)
    finally:
        go_on.set()
        daemon.stop()


def _rest_listens(address: str) -> bool:
    host, _, port = address.rpartition(":")
    with socket.socket() as sock:
        return sock.connect_ex((host, int(port))) == 0
