"""The docker backend end to end: `rhizomed --backend docker` on the session's real engine,
learners as containers. Jobs complete, halt and resume; a learner container killed with
`docker kill` is recovered as on the local backend; a daemon SIGKILLed mid-deploy leaves
no orphan; jobs cannot read each other's files; limits and the non-root, read-only
container are what `docker inspect` shows; bad images and OOM kills end with clear
messages."""

from __future__ import annotations

import contextlib
import io
import tarfile
from pathlib import Path
from typing import Any

import docker
import pytest

from services.backends.docker.spec import LABEL_JOB, LABEL_RANK
from services.client.sdk import Client
from services.images.build import LEARNER_UID, REPO_ROOT
from services.store import states
from services.store.jobs import JobsRepository
from services.store.mongo import connect
from tests.docker.conftest import DockerPlatform
from tests.services.guardian.helpers import code_zip, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.docker]

# Steps of 0.2 s; progress kept in the checkpoint directory so a restart goes on from it.
# Once a test opened the job's gate (`open_gate`: what it tests happened), the rest of
# the steps take no time.
STEPPER = (
    'n=$(cat "$RHIZOME_CHECKPOINT_DIR/step-$RANK" 2>/dev/null || echo 0)\n'
    'echo "start at $n as $(id -u)"\n'
    'while [ $n -lt $STEPS ]; do [ -e "$RHIZOME_JOB_DIR/go" ] || sleep 0.2; n=$((n+1)); '
    'echo $n > "$RHIZOME_CHECKPOINT_DIR/step-$RANK"; echo "step $n"; done\n'
)
TERMINAL = {states.COMPLETED, states.FAILED, states.HALTED, states.DELETED}


def manifest(
    name: str,
    command: str,
    learners: int = 1,
    restarts: int = 2,
    memory: str = "256MiB",
    cpus: float = 0.5,
    extra: str = "",
) -> str:
    return (
        f"name: {name}\nlearners: {learners}\nmemory: {memory}\ncpus: {cpus}\n"
        f"max_learner_restarts: {restarts}\nframework:\n  command: {command!r}\n{extra}"
    )


def status(platform: DockerPlatform, job_id: str) -> Any:
    return jobs(platform).get(job_id)


_repos: dict[str, JobsRepository] = {}


def jobs(platform: DockerPlatform) -> JobsRepository:
    uri = next(a for a in platform.args if a.startswith("--mongodb-uri=")).split("=", 1)[1]
    if uri not in _repos:
        _repos[uri] = JobsRepository(connect(uri))
    return _repos[uri]


def wait_status(
    platform: DockerPlatform, job_id: str, wanted: set[str], timeout: float = 120
) -> Any:
    wait_for(
        f"{job_id} to be {sorted(wanted)}",
        lambda: status(platform, job_id).status in wanted,
        timeout,
    )
    return status(platform, job_id)


def containers(client: docker.DockerClient, job_id: str, all: bool = True) -> list[Any]:
    return client.containers.list(all=all, filters={"label": f"{LABEL_JOB}={job_id}"})


def learner_log(platform: DockerPlatform, job_id: str, rank: int = 0) -> str:
    """The learner's stdout: its containers' streams, as the job's collector shipped them."""
    return platform.learner_output(job_id, rank)


def open_gate(platform: DockerPlatform, job_id: str) -> None:
    """STEPPER's remaining steps take no time from now on."""
    (platform.data_dir / "jobs" / job_id / "go").touch()


def step_of(platform: DockerPlatform, job_id: str, rank: int = 0) -> int:
    path = platform.data_dir / "jobs" / job_id / "checkpoints" / f"step-{rank}"
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text().strip() or 0)
    return 0


@pytest.fixture(scope="module")
def client(docker_platform: DockerPlatform) -> Any:
    with Client(docker_platform.address, token=docker_platform.token()) as c:
        yield c


def test_job_completes_in_containers_as_non_root_with_limits(
    docker_platform: DockerPlatform, client: Client, docker_client: docker.DockerClient
) -> None:
    job_id = client.create_job(
        manifest("limits", "STEPS=12 sh run.sh", learners=2, cpus=0.5, memory="300MiB"),
        code_zip({"run.sh": STEPPER}),
    ).job_id
    wait_for(
        "both learner containers to run",
        lambda: len(containers(docker_client, job_id, all=False)) == 2,
        120,
    )
    job_dir = docker_platform.data_dir / "jobs" / job_id
    for container in containers(docker_client, job_id, all=False):
        attrs = container.attrs
        host, config = attrs["HostConfig"], attrs["Config"]
        rank = config["Labels"][LABEL_RANK]
        assert container.name.startswith(f"rz-{job_id}-{rank}-g")
        assert set(config["Labels"]) >= {"rhizome.job", "rhizome.rank", "rhizome.generation"}
        assert config["User"] == f"{LEARNER_UID}:{LEARNER_UID}"
        assert host["ReadonlyRootfs"] is True
        assert host["Memory"] == 300 * 1024 * 1024
        assert host["MemorySwap"] == 300 * 1024 * 1024
        assert host["NanoCpus"] == 500_000_000
        assert host["PidsLimit"] == 4096
        assert host["NetworkMode"] == "host"  # this engine has no bridge
        assert host["CapDrop"] == ["ALL"]
        assert "/tmp" in host["Tmpfs"]
        mounts = {m["Destination"]: m for m in attrs["Mounts"]}
        assert mounts[str(REPO_ROOT)]["RW"] is False
        assert mounts[str(job_dir)]["RW"] is True
        secrets = str(job_dir / "secrets" / "env")
        assert mounts[secrets]["RW"] is False
        # Only this job's directory of the data directory is mounted.
        assert not any(
            d.startswith(str(docker_platform.data_dir / "jobs")) and not d.startswith(str(job_dir))
            for d in mounts
        )
        # The credentials come from a tmpfs of the host, never the job directory's disk.
        source = Path(mounts[secrets]["Source"])
        assert source.is_relative_to("/dev/shm"), source
        st = source.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (LEARNER_UID, 0o400)
    on_disk = job_dir / "secrets" / "env"  # at most the empty mount point
    assert not on_disk.exists() or on_disk.stat().st_size == 0
    record = wait_status(docker_platform, job_id, TERMINAL)
    assert record.status == states.COMPLETED, record.status_message
    assert not source.parent.exists()  # the job's rollback removed its credentials
    for rank in (0, 1):
        out = learner_log(docker_platform, job_id, rank)
        assert f"start at 0 as {LEARNER_UID}" in out and "step 12" in out
    wait_for(
        "the job's containers to be removed", lambda: containers(docker_client, job_id) == [], 30
    )


def test_mnist_completes_in_a_container(
    docker_platform: DockerPlatform, client: Client, docker_client: docker.DockerClient
) -> None:
    from services.client.sdk import zip_directory

    text = (REPO_ROOT / "examples" / "mnist" / "manifest.yml").read_text()
    text = text.replace("--epochs 10", "--epochs 2")
    job_id = client.create_job(text, zip_directory(REPO_ROOT / "examples" / "mnist")).job_id
    record = wait_status(docker_platform, job_id, TERMINAL, timeout=300)
    assert record.status == states.COMPLETED, (record.status_message, record.last_log_lines)
    out = learner_log(docker_platform, job_id)
    assert "epoch 2/2" in out and "test_accuracy=" in out
    assert containers(docker_client, job_id) == []


def test_halt_and_resume_go_on_from_the_checkpoint(
    docker_platform: DockerPlatform, client: Client, docker_client: docker.DockerClient
) -> None:
    job_id = client.create_job(
        manifest("halts", "STEPS=25 sh run.sh"), code_zip({"run.sh": STEPPER})
    ).job_id
    wait_for("a few steps", lambda: step_of(docker_platform, job_id) >= 3, 120)
    client.halt_job(job_id, "test halt")
    record = wait_status(docker_platform, job_id, TERMINAL)
    assert record.status == states.HALTED, record.status_message
    halted_at = step_of(docker_platform, job_id)
    assert 3 <= halted_at < 25
    wait_for("no container after the halt", lambda: containers(docker_client, job_id) == [], 30)
    open_gate(docker_platform, job_id)
    client.resume_job(job_id, "test resume")
    record = wait_status(docker_platform, job_id, {states.COMPLETED, states.FAILED}, 120)
    assert record.status == states.COMPLETED, record.status_message
    assert f"start at {halted_at} as {LEARNER_UID}" in learner_log(docker_platform, job_id)
    assert step_of(docker_platform, job_id) == 25
    assert containers(docker_client, job_id) == []


def test_docker_kill_of_a_learner_container_is_recovered(
    docker_platform: DockerPlatform, client: Client, docker_client: docker.DockerClient
) -> None:
    job_id = client.create_job(
        manifest("killed", "STEPS=25 sh run.sh", restarts=2), code_zip({"run.sh": STEPPER})
    ).job_id
    wait_for("a few steps", lambda: step_of(docker_platform, job_id) >= 3, 120)
    (victim,) = containers(docker_client, job_id, all=False)
    victim.kill()  # `docker kill`: SIGKILL to the whole container
    open_gate(docker_platform, job_id)
    record = wait_status(docker_platform, job_id, TERMINAL, 120)
    assert record.status == states.COMPLETED, record.status_message
    out = learner_log(docker_platform, job_id)
    assert out.count("start at 0") == 1 and "step 25" in out
    assert any(
        line.startswith("start at ") and not line.startswith("start at 0")
        for line in out.splitlines()
    )
    assert containers(docker_client, job_id) == []


def test_jobs_cannot_read_each_others_files(
    docker_platform: DockerPlatform, client: Client, docker_client: docker.DockerClient
) -> None:
    owner = client.create_job(
        manifest("owner", 'echo s3cret > "$RHIZOME_CHECKPOINT_DIR/mine"; sleep 60', restarts=0),
        code_zip({"run.sh": "true\n"}),
    ).job_id
    owner_dir = docker_platform.data_dir / "jobs" / owner
    wait_for("the owner's file", lambda: (owner_dir / "checkpoints" / "mine").exists(), 120)
    snoop = client.create_job(
        manifest(
            "snoop",
            f"ls {owner_dir}; cat {owner_dir}/checkpoints/mine {owner_dir}/secrets/env",
            restarts=0,
        ),
        code_zip({"run.sh": "true\n"}),
    ).job_id
    record = wait_status(docker_platform, snoop, TERMINAL, 120)
    assert record.status == states.FAILED
    text = "\n".join(record.last_log_lines)
    assert "No such file or directory" in text and "s3cret" not in text
    client.delete_job(owner, "done")
    wait_status(docker_platform, owner, {states.DELETED}, 60)
    wait_for(
        "no container of either job",
        lambda: not containers(docker_client, owner) and not containers(docker_client, snoop),
        30,
    )


def test_oom_kill_fails_the_job_saying_so(
    docker_platform: DockerPlatform, client: Client, docker_client: docker.DockerClient
) -> None:
    hog = "b = bytearray(768 * 1024 * 1024)\nfor i in range(0, len(b), 4096):\n    b[i] = 1\n"
    job_id = client.create_job(
        manifest("hog", "python hog.py", restarts=0, memory="200MiB"), code_zip({"hog.py": hog})
    ).job_id
    record = wait_status(docker_platform, job_id, TERMINAL, 120)
    assert record.status == states.FAILED
    assert "exited with code 137" in record.status_message
    assert "out of memory" in record.status_message and "200 MiB" in record.status_message
    assert containers(docker_client, job_id) == []


def _empty_image(docker_client: docker.DockerClient) -> str:
    """An image with one file and nothing else: no shell, no libc, no entry point."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("README")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"empty"))
    docker_client.api.import_image_from_data(buf.getvalue(), repository="rz-test-empty", tag="1")
    return "rz-test-empty:1"


@pytest.mark.parametrize("which", ["missing", "no-entry-point"])
def test_a_bad_image_fails_the_job_clearly_and_leaves_nothing(
    which: str, docker_platform: DockerPlatform, client: Client, docker_client: docker.DockerClient
) -> None:
    image = "rz-test-no-such-image:404" if which == "missing" else _empty_image(docker_client)
    job_id = client.create_job(
        manifest("badimage", "true", extra=f"  image: {image}\n"), code_zip({"run.sh": "true\n"})
    ).job_id
    record = wait_status(docker_platform, job_id, TERMINAL, 120)
    assert record.status == states.FAILED
    assert image in record.status_message
    if which == "missing":
        assert "does not exist" in record.status_message
    else:
        assert "lacks the learner entry point" in record.status_message
    assert containers(docker_client, job_id) == []
