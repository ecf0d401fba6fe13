"""Supervision and honest health (issue #15), against real servers: the daemon SIGKILLed
under `rhizome up` is restarted by the supervisor and a job submitted before completes;
`rhizome down` stops everything and nothing comes back; the daemon's gRPC health says
NOT_SERVING while its MongoDB is down, and SERVING again once it returns."""

from __future__ import annotations

import io
import os
import shlex
import signal
import time
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contract.procs import pid_alive
from services.embedded import platform
from services.embedded.servers import MongoServer
from tests.integration.conftest import start_api

pytestmark = pytest.mark.integration

T = TypeVar("T")

MANIFEST = """name: survives-a-daemon-crash
learners: 1
memory: 256MiB
framework:
  command: sh run.sh
"""
# Runs until the test opens its gate, once the daemon died and came back (at most 2
# minutes): a fixed 10 s was longer than that on an idle machine, and maybe shorter on a
# loaded one.
SCRIPT = (
    "i=0\nwhile [ ! -e {gate} ] && [ $i -lt 480 ]; do sleep 0.25; i=$((i+1)); done\necho finished\n"
)


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = 120.0) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def health_status(address: str) -> int | None:
    """The server-wide health status, or None when nothing answers."""
    channel = grpc.insecure_channel(address)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status)
    except grpc.RpcError:
        return None
    finally:
        channel.close()


def code_zip(gate: Path) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("run.sh", SCRIPT.format(gate=shlex.quote(str(gate))))
    return buf.getvalue()


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[Path]:
    data_dir = tmp_path / "platform"
    try:
        platform.up(data_dir, grpc_port=0, rest_port=0)
        yield data_dir
    finally:
        platform.down(data_dir)


def test_daemon_killed_under_up_is_restarted_and_its_job_completes(
    embedded: Path, tmp_path: Path
) -> None:
    from rhizome.v1 import job_pb2

    from services.client.sdk import Client

    state = platform.load_state(embedded)
    assert state is not None and state.supervisor
    first_pid = int(state.processes["api"]["pid"])
    with Client(state.api_address, data_dir=embedded) as client:
        job_id = client.create_job(MANIFEST, code_zip(tmp_path / "go")).job_id
        wait_for(
            "the job to run",
            lambda: client.get_job(job_id).status == job_pb2.JobStatus.Value("PROCESSING"),
        )

    os.kill(first_pid, signal.SIGKILL)

    def restarted() -> platform.PlatformState | None:
        now = platform.load_state(embedded)
        if now is None or int(now.processes["api"]["pid"]) == first_pid:
            return None
        return now

    state = wait_for("the supervisor to restart the daemon", restarted)
    assert state.processes["api"]["restarts"] == 1
    wait_for(
        "the restarted daemon to serve",
        # `up` serves TLS by default: ask the way the CLI does, trusting the platform's CA.
        lambda: platform.grpc_serving(
            state.api_address,
            timeout_s=2,
            tls=state.tls,
            ca=Path(state.tls_ca).read_bytes() if state.tls_ca else None,
        ),
    )
    (tmp_path / "go").touch()  # the job, still running, may end now
    with Client(state.api_address, data_dir=embedded) as client:
        done = {"COMPLETED", "FAILED", "HALTED", "DELETED"}

        def ended() -> str | None:
            name = job_pb2.JobStatus.Name(client.get_job(job_id).status)  # type: ignore[arg-type]
            return name if name in done else None

        assert wait_for("the job to end", ended, 180) == "COMPLETED"

    log = Path(state.supervisor["log"]).read_text()
    assert f"api (pid {first_pid}) died" in log and "restarted api" in log
    metrics = urllib.request.urlopen(state.urls["supervisor-metrics"], timeout=5).read().decode()
    assert 'rhizome_supervised_restarts_total{process="api"} 1.0' in metrics

    # down stops the supervisor first: nothing it stops comes back.
    supervisor_pid = int(state.supervisor["pid"])
    pids = [int(p["pid"]) for p in state.processes.values()]
    assert platform.down(embedded)
    assert not pid_alive(supervisor_pid)
    assert not any(pid_alive(pid) for pid in pids)
    after = platform.load_state(embedded)
    assert after is not None and after.processes == {} and after.supervisor == {}


def test_health_is_not_serving_while_mongodb_is_down_then_serving_again(
    tmp_path: Path,
) -> None:
    mongo = MongoServer(tmp_path / "mongo")
    mongo.start()
    back: MongoServer | None = None
    running = start_api(mongo.url, tmp_path / "daemon")
    try:
        address = running.grpc
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        wait_for("SERVING", lambda: health_status(address) == serving)
        mongo.kill()
        wait_for("NOT_SERVING with MongoDB down", lambda: health_status(address) == not_serving)
        back = MongoServer(tmp_path / "mongo", mongo.port)
        back.start()
        wait_for("SERVING once MongoDB is back", lambda: health_status(address) == serving)
        assert running.daemon.health_monitor.failing == {}
    finally:
        running.daemon.stop()
        if back is not None:
            back.stop()
        mongo.stop()


def test_backoff_doubles_per_restart_caps_and_resets_once_stable() -> None:
    from services.embedded.supervisor import Backoff

    b = Backoff(initial_s=0.5, max_s=2.0, stable_s=30.0)
    delays = []
    now = 0.0
    for _ in range(4):
        delay = b.dead("etcd", now)
        assert delay is not None and b.dead("etcd", now) is None  # counted once per death
        delays.append(delay)
        assert not b.ready("etcd", now) and b.ready("etcd", now + delay)
        b.restarted("etcd", now + delay)
        now += delay + 1.0
        b.alive("etcd", now)  # up for a second only: no reset
    assert delays == [0.5, 1.0, 2.0, 2.0]
    b.alive("etcd", now + 30.0)  # stayed up: the next death waits the initial delay
    assert b.dead("etcd", now + 31.0) == 0.5
