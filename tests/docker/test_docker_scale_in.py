"""`rhizome scale JOB N` down on the docker backend (the session's real engine, the
daemon with `--backend docker`): the highest rank's container is stopped (SIGTERM, then
the grace), the other learners' containers keep running, and the job goes on PROCESSING
on fewer learners with the change in its history."""

from __future__ import annotations

import docker
import pytest

from services.backends.docker.spec import LABEL_RANK
from services.client.sdk import Client
from services.store import states
from tests.docker.conftest import DockerPlatform
from tests.docker.test_docker_backend import STEPPER, containers, manifest, status, wait_status
from tests.services.guardian.helpers import code_zip, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.docker]


def running_ranks(client: docker.DockerClient, job_id: str) -> list[str]:
    return sorted(c.labels[LABEL_RANK] for c in containers(client, job_id, all=False))


def test_scale_in_stops_the_highest_ranks_container_and_the_job_runs_on(
    docker_platform: DockerPlatform, docker_client: docker.DockerClient
) -> None:
    with Client(docker_platform.address, token=docker_platform.token()) as client:
        job_id = client.create_job(
            manifest(
                "scalein", "STEPS=100000 sh run.sh", learners=2, extra="elastic: {min: 1, max: 2}\n"
            ),
            code_zip({"run.sh": STEPPER}),
        ).job_id
        try:
            wait_status(docker_platform, job_id, {states.PROCESSING})
            wait_for("both containers", lambda: running_ranks(docker_client, job_id) == ["0", "1"])
            client.scale_job(job_id, 1)
            wait_for(
                "the scale-in applied",
                lambda: any(
                    "scaled 2 → 1 learners" in h.message
                    for h in status(docker_platform, job_id).history
                ),
                timeout_s=60,
            )
            record = status(docker_platform, job_id)
            assert record.status == states.PROCESSING
            assert int(record.resources["learners"]) == 1
            assert running_ranks(docker_client, job_id) == ["0"]
        finally:
            client.delete_job(job_id)
            # ended before the platform stops: its guardian is not stopped mid-delete
            wait_status(docker_platform, job_id, {states.DELETED}, 60)
