"""The docker backend's foundation, against a real engine: our dockerd's lifecycle, the
offline learner image, limits and OOM kills as the engine reports them, and the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from contract.procs import pid_alive
from services.embedded.docker_engine import DockerEngine, engine_answers, mounts_under
from services.images.build import (
    BASE_IMAGE,
    LEARNER_UID,
    REPO_ROOT,
    learner_environment,
    learner_mounts,
)
from tests.docker.conftest import LearnerImage

pytestmark = [pytest.mark.integration, pytest.mark.docker]

LABEL = "org.rhizome.test"


@pytest.fixture
def token(docker_client: docker.DockerClient) -> Iterator[str]:
    """A label value unique to the test; whatever carries it is removed afterwards."""
    value = uuid.uuid4().hex[:12]
    yield value
    for container in docker_client.containers.list(all=True, filters={"label": f"{LABEL}={value}"}):
        container.remove(force=True)


def run_learner(
    client: docker.DockerClient, image: str, token: str, command: list[str], **kwargs: Any
) -> Any:
    """A detached container the way the docker backend will run learners."""
    return client.containers.run(
        image,
        command,
        detach=True,
        user=f"{LEARNER_UID}:{LEARNER_UID}",
        read_only=True,
        network_mode="host",
        mounts=learner_mounts(),
        environment=learner_environment(),
        tmpfs={"/tmp": "size=64m"},
        labels={LABEL: token},
        **kwargs,
    )


def rhizome(*args: str, docker_host: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DOCKER_HOST=docker_host)
    return subprocess.run(
        [sys.executable, "-m", "services.client.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=600,
    )


def test_engine_starts_and_stops_by_pid_leaving_no_mount() -> None:
    if os.environ.get("DOCKER_HOST") and shutil.which("dockerd") is None:
        pytest.skip("DOCKER_HOST names your engine and there is no dockerd to start here")
    data_dir = Path(tempfile.mkdtemp(prefix="rzd-", dir="/tmp"))
    engine = DockerEngine(data_dir, docker_host="")  # our own, even when DOCKER_HOST is set
    try:
        started = time.monotonic()
        info = engine.start()
        print(f"engine start: {time.monotonic() - started:.2f} s")
        assert info.pid > 0 and pid_alive(info.pid)
        assert int((data_dir / "dockerd.pid").read_text()) == info.pid
        assert engine_answers(engine.url)
        client = engine.client()
        try:
            assert client.info()["Driver"] == "overlay2"
            # --bridge=none: nothing but host and none networks, nothing touched on the host.
            assert {n.name for n in client.networks.list()} <= {"host", "none"}
        finally:
            client.close()
        stopping = time.monotonic()
        engine.stop()
        print(f"engine stop: {time.monotonic() - stopping:.2f} s")
        assert not pid_alive(info.pid)
        assert not engine_answers(engine.url)
        assert mounts_under(data_dir) == [], "the engine left mounts behind"
        leftovers = [
            p.parent.name
            for p in Path("/proc").glob("[0-9]*/cmdline")
            if str(data_dir) in p.read_bytes().decode(errors="replace")
        ]
        assert leftovers == [], f"processes of the stopped engine still run: {leftovers}"
    finally:
        engine.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def test_learner_image_is_non_root_with_the_learner_entry_point(
    docker_client: docker.DockerClient, learner_image: LearnerImage
) -> None:
    image = docker_client.images.get(learner_image.tag)
    assert image.id == learner_image.result.image_id
    config = image.attrs["Config"]
    assert config["User"] == f"{LEARNER_UID}:{LEARNER_UID}"
    assert config["Cmd"] == ["python", "-m", "learner.controller"]
    assert config["Labels"]["org.rhizome.image"] == "learner"
    base_id = docker_client.images.get(BASE_IMAGE).id
    assert base_id in {layer["Id"] for layer in image.history()}


def test_learner_imports_torch_read_only_as_uid_10001_with_limits(
    docker_client: docker.DockerClient, learner_image: LearnerImage, token: str
) -> None:
    script = (
        "import os, time; t = time.monotonic()\n"
        "import torch, learner.controller\n"
        "took = time.monotonic() - t\n"
        "try:\n"
        "    open('/written', 'w')\n"
        "    ro = 'writable'\n"
        "except OSError:\n"
        "    ro = 'read-only'\n"
        "print(os.getuid(), os.getgid(), torch.__version__, ro, f'{took:.2f}')\n"
    )
    started = time.monotonic()
    container = run_learner(
        docker_client,
        learner_image.tag,
        token,
        ["python", "-c", script],
        mem_limit="1g",
        nano_cpus=1_000_000_000,
        pids_limit=200,
    )
    print(f"container start: {time.monotonic() - started:.2f} s")
    status = container.wait(timeout=300)
    output = container.logs().decode(errors="replace")
    print(f"container done after {time.monotonic() - started:.2f} s: {output.strip()}")
    assert status["StatusCode"] == 0, output
    uid, gid, _torch, ro, _took = output.split()
    assert (uid, gid, ro) == (str(LEARNER_UID), str(LEARNER_UID), "read-only")

    container.reload()
    host = container.attrs["HostConfig"]
    assert host["Memory"] == 1 << 30
    assert host["NanoCpus"] == 1_000_000_000
    assert host["PidsLimit"] == 200
    assert host["ReadonlyRootfs"] is True
    assert host["NetworkMode"] == "host"
    assert container.attrs["Config"]["User"] == f"{LEARNER_UID}:{LEARNER_UID}"
    mounts = {m["Destination"]: m for m in container.attrs["Mounts"]}
    for mount in learner_mounts():
        assert mounts[mount["Target"]]["RW"] is False, mount["Target"]
    assert str(REPO_ROOT) in mounts


def test_oom_kill_arrives_through_the_event_stream_filtered_by_label(
    docker_client: docker.DockerClient, learner_image: LearnerImage, token: str
) -> None:
    since = int(time.time()) - 1
    container = run_learner(
        docker_client,
        learner_image.tag,
        token,
        ["python", "-c", "block = b'x' * (256 << 20)"],
        mem_limit="64m",
        memswap_limit="64m",  # no swap to spill into: the cgroup must OOM-kill
        nano_cpus=500_000_000,
        pids_limit=100,
    )
    assert container.wait(timeout=120)["StatusCode"] == 137
    # Bounded by `until`, the stream returns what happened instead of waiting for more.
    events = list(
        docker_client.events(
            since=since,
            until=int(time.time()) + 1,
            filters={"type": "container", "label": f"{LABEL}={token}"},
            decode=True,
        )
    )
    actions = [e["Action"] for e in events]
    assert "oom" in actions, actions
    dies = [e for e in events if e["Action"] == "die"]
    assert [d["Actor"]["Attributes"]["exitCode"] for d in dies] == ["137"]
    assert all(e["Actor"]["Attributes"][LABEL] == token for e in events)
    container.reload()
    assert container.attrs["State"]["OOMKilled"] is True
    assert container.attrs["State"]["ExitCode"] == 137


def test_image_build_twice_reuses_the_base(
    docker_engine: DockerEngine, learner_image: LearnerImage
) -> None:
    print("session build:", *learner_image.progress, sep="\n  ")
    assert learner_image.result.base in {"engine", "cache", "debootstrap"}
    runs = []
    for _ in range(2):
        started = time.monotonic()
        done = rhizome("image", "build", "--offline", "--json", docker_host=docker_engine.url)
        runs.append((done, time.monotonic() - started))
        assert done.returncode == 0, done.stderr
    (first, _), (second, second_s) = runs
    print(f"second `rhizome image build --offline`: {second_s:.1f} s")
    assert "skipping debootstrap" in second.stderr
    assert "debootstrap --variant" not in second.stderr
    one, two = json.loads(first.stdout), json.loads(second.stdout)
    assert two["base"] == "engine"
    assert one["image_id"] == two["image_id"] == learner_image.result.image_id
    assert two["tag"] == learner_image.tag


def test_unreachable_engine_gives_one_clear_line() -> None:
    socket_path = f"/tmp/rz-no-engine-{uuid.uuid4().hex[:8]}/docker.sock"
    done = rhizome("image", "build", "--offline", docker_host=f"unix://{socket_path}")
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert socket_path in lines[0]
    assert "DOCKER_HOST" in lines[0] and "rhizome up --embedded --backend docker" in lines[0]
