"""The chaos scenario of tests/chaos/test_chaos.py on the docker backend: the daemon,
guardians and learner controllers (processes inside the learner containers, found by
their labels in /proc) SIGKILLed at random while a workload of jobs runs. Every job
reaches its expected end, at no sampled moment do two learners of one rank run, and
afterwards no container, volume or network labelled with any of the jobs is left in the
engine. (A module of its own: its daemon must be the only LCM on the session's etcd.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import docker
import pytest

from services.backends.docker.spec import LABEL_JOB
from services.embedded.docker_engine import DockerEngine
from tests.chaos.test_chaos import Platform, chaos_scenario, orphan_reaper  # noqa: F401
from tests.services.guardian.helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.chaos]


def labelled(client: docker.DockerClient, job_id: str) -> list[str]:
    wanted = {"label": f"{LABEL_JOB}={job_id}"}
    return [
        *(f"container {c.name}" for c in client.containers.list(all=True, filters=wanted)),
        *(f"volume {v.name}" for v in client.volumes.list(filters=wanted)),
        *(f"network {n.name}" for n in client.networks.list(filters=wanted)),
    ]


def test_jobs_survive_repeated_sigkills_on_the_docker_backend(
    etcd_server: Any,
    mongo_server: Any,
    docker_engine: DockerEngine,
    docker_client: docker.DockerClient,
    learner_image: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    orphan_reaper: None,  # noqa: F811
) -> None:
    monkeypatch.setenv("RHIZOME_DEPLOY_ATTEMPTS", "20")
    monkeypatch.setenv("RHIZOME_LEARNER_GRACE_S", "2")
    platform = Platform(
        tmp_path,
        etcd_server.url,
        mongo_server.url,
        extra_args=["--backend=docker", f"--docker-host={docker_engine.url}"],
    )
    job_ids = chaos_scenario(platform, etcd_server.url, mongo_server.url)
    for job_id in job_ids:

        def gone(j: str = job_id) -> bool:
            return labelled(docker_client, j) == []

        wait_for(f"nothing of {job_id} in the engine", gone, 60)
