"""The log tests of tests/integration/test_logs_e2e.py on the docker backend, against the
session's real engine: `rhizome up --embedded --backend docker`, so learners are
containers whose output streams the job's log collector (a process beside the guardian,
learner/controller/container_logs.py) ships to the Elasticsearch-API server.

Every line reaches the search server once, in order: `rhizome logs --follow` shows them
and returns when the job ends, the regex metric source is fed from the container's stdout,
a failed job's record carries its last lines; and when the collector is SIGKILLed mid-job,
or the daemon, the job's guardian and its collector are all SIGKILLed together, the
restarted collector resumes without losing or repeating a line.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from contract import procs
from contract.containers import COLLECTOR_LOCK_FILE
from services.embedded.docker_engine import DockerEngine
from tests.docker.conftest import LearnerImage
from tests.integration.test_cli import rz
from tests.integration.test_logs_e2e import MANIFEST, SCRIPT
from tests.services.guardian.helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.docker]

# Numbered lines at a pace that leaves time to kill things in the middle (the CLI calls
# that watch the job take seconds each on a busy machine), and never past half way until
# the test opens the gate (`go` in the job's directory) once the restarted collector
# runs: then the rest comes at once (the fixed pace took 24 s).
NUMBERED = """import os, sys, time
n = int(sys.argv[1])
gate = os.path.join(os.environ["RHIZOME_JOB_DIR"], "go")
for i in range(n):
    print(f"line {i:05d}", flush=True)
    if i == n // 2 - 1:
        while not os.path.exists(gate):
            time.sleep(0.1)
    if i % 25 == 24 and not os.path.exists(gate):
        time.sleep(1.0)
print("done", flush=True)
"""
LINES = 600


@pytest.fixture(scope="module")
def platform(
    docker_engine: DockerEngine,
    learner_image: LearnerImage,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Path]:
    data_dir = Path(tmp_path_factory.mktemp("docker-logs"))
    saved = os.environ.get("DOCKER_HOST")
    # The session's engine: `up` then starts none of its own and `down` leaves it alone.
    os.environ["DOCKER_HOST"] = docker_engine.url
    try:
        rz(
            data_dir,
            "up",
            "--embedded",
            "--backend",
            "docker",
            "--grpc-port",
            "0",
            "--rest-port",
            "0",
        )
        try:
            yield data_dir
        finally:
            rz(data_dir, "down", check=False)
    finally:
        if saved is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = saved


def submit(platform: Path, folder: Path, script: str, manifest: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.py").write_text(script)
    (folder / "manifest.yml").write_text(manifest)
    out = rz(platform, "train", str(folder / "manifest.yml"), "--json").stdout
    return str(json.loads(out)["job_id"])


def show(platform: Path, job_id: str) -> dict[str, Any]:
    return dict(json.loads(rz(platform, "show", job_id, "--json").stdout))


def logged(platform: Path, job_id: str) -> list[dict[str, Any]]:
    out = rz(platform, "logs", job_id, "--json").stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def collector_of(platform: Path, job_id: str) -> procs.ProcRef | None:
    """The job's log collector: the pid in the lock file it holds, if that process lives."""
    lock = platform / "jobs" / ".container-logs" / job_id / COLLECTOR_LOCK_FILE
    try:
        held = json.loads(lock.read_text() or "{}")
    except (OSError, ValueError):
        return None
    ref = procs.ProcRef(int(held.get("pid", 0)), int(held.get("start", -1)))
    return ref if ref.alive() else None


def open_gate(platform: Path, job_id: str) -> None:
    """Let NUMBERED print the rest of its lines at once."""
    (platform / "jobs" / job_id / "go").touch()


def shipped(platform: Path, job_id: str) -> int:
    return sum(1 for line in logged(platform, job_id) if line["stream"] == "stdout")


def assert_exactly_once(platform: Path, job_id: str) -> None:
    lines = [ln for ln in logged(platform, job_id) if ln["stream"] == "stdout"]
    texts = [ln["line"] for ln in lines]
    assert texts == [f"line {i:05d}" for i in range(LINES)] + ["done"]
    assert sorted(int(ln.get("seq", 0)) for ln in lines) == list(range(LINES + 1))


def numbered_manifest(name: str) -> str:
    return f"name: {name}\nmemory: 256MiB\nframework:\n  command: python train.py {LINES}\n"


def test_follow_shows_every_line_and_returns_when_the_job_ends(
    platform: Path, tmp_path: Path
) -> None:
    job_id = submit(platform, tmp_path, SCRIPT, MANIFEST)
    followed = rz(platform, "logs", job_id, "--follow").stdout.splitlines()
    assert followed == [f"[0/stdout] step {s} loss={1.0 / s:.4f}" for s in range(1, 6)] + [
        "[0/stdout] training done"
    ]
    assert show(platform, job_id)["status"] == "COMPLETED"
    samples = json.loads(rz(platform, "metrics", job_id, "--json").stdout)
    assert sorted((int(s["step"]), round(s["value"], 4)) for s in samples) == [
        (s, round(1.0 / s, 4)) for s in range(1, 6)
    ]
    tail = rz(platform, "logs", job_id, "--tail", "2").stdout.splitlines()
    assert tail == ["[0/stdout] step 5 loss=0.2000", "[0/stdout] training done"]
    # The controller's own log is not in the container's streams, so not in the job's.
    assert all(not line.startswith("[0/stderr]") for line in followed)


def test_show_of_a_failed_job_prints_its_last_lines(platform: Path, tmp_path: Path) -> None:
    job_id = submit(
        platform,
        tmp_path,
        "print('about to fail', flush=True)\nraise SystemExit('bad input: no data')\n",
        "name: fails\nmemory: 256MiB\nmax_learner_restarts: 0\nframework:\n  command: python train.py\n",
    )
    assert rz(platform, "logs", job_id, "--follow").returncode == 0
    shown = rz(platform, "show", job_id).stdout
    assert "FAILED" in shown
    assert "about to fail" in shown and "bad input: no data" in shown
    streams = {(ln["stream"], ln["line"]) for ln in logged(platform, job_id)}
    assert ("stdout", "about to fail") in streams and ("stderr", "bad input: no data") in streams


def test_a_killed_collector_is_restarted_and_loses_or_repeats_no_line(
    platform: Path, tmp_path: Path
) -> None:
    job_id = submit(platform, tmp_path, NUMBERED, numbered_manifest("collector-kill"))
    wait_for("the collector to ship some lines", lambda: shipped(platform, job_id) >= 50, 120)
    first = collector_of(platform, job_id)
    assert first is not None, "the job's log collector does not run"
    os.kill(first.pid, signal.SIGKILL)
    wait_for(
        "the guardian to start a new collector",
        lambda: (ref := collector_of(platform, job_id)) is not None and ref != first,
        60,
    )
    open_gate(platform, job_id)
    wait_for("the job to complete", lambda: show(platform, job_id)["status"] == "COMPLETED", 180)
    assert_exactly_once(platform, job_id)


def test_the_daemon_guardian_and_collector_killed_together_lose_or_repeat_no_line(
    platform: Path, tmp_path: Path
) -> None:
    job_id = submit(platform, tmp_path, NUMBERED, numbered_manifest("all-killed"))
    wait_for("the collector to ship some lines", lambda: shipped(platform, job_id) >= 50, 120)
    status = json.loads(rz(platform, "status", "--json").stdout)
    daemon = int(status["components"]["api"]["pid"])
    collector = collector_of(platform, job_id)
    assert collector is not None, "the job's log collector does not run"
    guardian = guardian_of(platform, str(status["urls"]["etcd"]), job_id)
    for pid in (daemon, guardian.pid, collector.pid):
        os.kill(pid, signal.SIGKILL)
    # `up`'s supervisor restarts the daemon; its LCM a guardian; the guardian the collector.
    wait_for(
        "a new collector",
        lambda: (ref := collector_of(platform, job_id)) is not None and ref != collector,
        120,
    )
    open_gate(platform, job_id)
    wait_for("the job to complete", lambda: show(platform, job_id)["status"] == "COMPLETED", 180)
    assert_exactly_once(platform, job_id)


def guardian_of(data_dir: Path, etcd_url: str, job_id: str) -> procs.ProcRef:
    """The job's guardian, from the lease key it holds in etcd (pid and start time); read
    as the platform's etcd user, since `up` turns etcd's authentication on."""
    from contract import etcd_keys
    from contract.etcd import EtcdClient
    from services.security.etcd_auth import platform_credentials

    etcd = EtcdClient(etcd_url, credentials=platform_credentials(data_dir))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        held = etcd.get(etcd_keys.guardian_lease(job_id))
        if held is not None and isinstance(held.value, dict):
            ref = procs.ProcRef(int(held.value["pid"]), int(held.value["start"]))
            if ref.alive():
                return ref
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} has no live guardian in etcd")
