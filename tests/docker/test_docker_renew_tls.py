"""A renewed TDS certificate reaches a running learner container on the session's real
engine (issue #15): `DockerBackend.renew_tls` writes `tds-tls.json` into the learner's
directory on the host, and the container — mounted as the backend mounts it
(`container_spec`), running as the learner's uid — reads the new certificate there, where
its controller's `RenewingStub` re-reads it (the renewal's files alone are tested in
tests/services/backends/test_docker_renew_tls.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from contract.credentials import TDS_TLS_FILE
from services.backends.docker.backend import DockerBackend
from services.backends.docker.spec import container_spec
from services.embedded.docker_engine import DockerEngine
from tests.docker.conftest import LearnerImage
from tests.services.backends.test_docker_spec import job

pytestmark = [pytest.mark.integration, pytest.mark.docker]

FIRST = {"ca": "CA PEM", "cert": "FIRST CERT", "key": "FIRST KEY"}
RENEWED = {"ca": "CA PEM", "cert": "RENEWED CERT", "key": "RENEWED KEY"}


@pytest.fixture
def backend(docker_engine: DockerEngine, learner_image: LearnerImage) -> Iterator[DockerBackend]:
    b = DockerBackend(docker_host=docker_engine.url, image=learner_image.tag)
    yield b
    b.close()


def test_a_renewal_reaches_a_running_learner_container(
    backend: DockerBackend,
    docker_client: docker.DockerClient,
    learner_image: LearnerImage,
    tmp_path: Path,
) -> None:
    job_dir = tmp_path / "jobs" / "job-renew"
    spec = job(
        tmp_path,
        job_id="job-renew",
        job_dir=str(job_dir),
        checkpoint_dir=str(job_dir / "checkpoints"),
        learners=1,
        model_zip="",  # no store to mount: the learner only sleeps
        result_store="",
    )
    learner = job_dir / "learners" / "0"
    learner.mkdir(parents=True)
    backend.renew_tls(spec, FIRST)  # the certificate it started with
    if backend.chown:  # as the backend leaves a learner's files: the container's uid's
        for path in (job_dir, job_dir / "learners", learner):
            os.chown(path, backend.options.uid, backend.options.gid)
    kwargs = container_spec(
        spec, 0, 0, str(learner / "spec.json"), backend.options, image=learner_image.tag
    )
    kwargs["command"] = ["sleep", "60"]  # a learner that runs; its controller is not tested
    container = docker_client.containers.create(**kwargs)
    try:
        container.start()
        inside = str(learner / TDS_TLS_FILE)  # the same path in the container

        def seen() -> dict[str, str]:
            code, out = container.exec_run(["cat", inside])
            assert code == 0, out.decode(errors="replace")
            return dict(json.loads(out))

        assert seen() == FIRST
        backend.renew_tls(spec, RENEWED)
        container.reload()
        assert container.status == "running"  # renewed under it, not restarted
        assert seen() == RENEWED
    finally:
        container.remove(force=True)
