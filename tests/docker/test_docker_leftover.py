"""A name clash with a leftover container, on the session's real engine: a container of
another owner under a learner's name fails the start with a message naming whose it is
and how to fix it, and is left alone; the job's own leftover (an earlier run of the rank
whose controller died) is stopped and renamed, not removed — its output stays readable
for the job's log collector — and the job's rollback removes it by label."""

from __future__ import annotations

from collections.abc import Iterator

import docker
import pytest

from services.backends.api import BackendError
from services.backends.docker.backend import DockerBackend
from services.backends.docker.spec import LABEL_JOB
from services.embedded.docker_engine import DockerEngine
from tests.docker.conftest import LearnerImage

pytestmark = [pytest.mark.integration, pytest.mark.docker]


@pytest.fixture
def backend(docker_engine: DockerEngine, learner_image: LearnerImage) -> Iterator[DockerBackend]:
    b = DockerBackend(docker_host=docker_engine.url, image=learner_image.tag)
    yield b
    b.close()


def sleeper(client: docker.DockerClient, image: str, name: str, labels: dict[str, str]) -> str:
    container = client.containers.run(
        image, ["sh", "-c", "echo last words; sleep 60"], name=name, labels=labels, detach=True
    )
    return str(container.id)


def test_a_foreign_container_under_the_name_fails_clearly_and_is_left_alone(
    backend: DockerBackend, docker_client: docker.DockerClient, learner_image: LearnerImage
) -> None:
    name = "rz-jclash-0-g1"
    cid = sleeper(docker_client, learner_image.tag, name, {"owner": "someone"})
    try:
        with pytest.raises(BackendError) as err:
            backend._remove_leftover(docker_client, name, "jclash")
        message = str(err.value)
        assert f"a container named {name} already exists and is not this job's" in message
        assert "remove it or rename it" in message
        assert docker_client.containers.get(cid).status == "running"
    finally:
        docker_client.containers.get(cid).remove(force=True)


def test_the_jobs_own_leftover_is_renamed_keeping_its_output_until_the_rollback(
    backend: DockerBackend,
    docker_client: docker.DockerClient,
    learner_image: LearnerImage,
    tmp_path: object,
) -> None:
    job_id = "jleft"
    name = f"rz-{job_id}-0-g1"
    cid = sleeper(docker_client, learner_image.tag, name, {LABEL_JOB: job_id})
    backend._remove_leftover(docker_client, name, job_id)
    kept = docker_client.containers.get(cid)
    assert kept.name == f"{name}-x{cid[:12]}" and kept.status != "running"
    assert b"last words" in kept.logs()
    with pytest.raises(docker.errors.NotFound):
        docker_client.containers.get(name)  # the name is free for the new run
    backend.rollback(job_id, str(tmp_path) + f"/jobs/{job_id}")
    with pytest.raises(docker.errors.NotFound):
        docker_client.containers.get(cid)
