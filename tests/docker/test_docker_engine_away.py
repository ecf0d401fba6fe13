"""The Docker engine going away in the middle of a deploy: the job ends FAILED with a
message naming the engine and how to bring one up, and what the rollback could not remove
while the engine was down is removed by the next deploy once it is back. An engine of its
own (stopped and started again by pid), so the session's engine is never touched; a
module of its own, since its daemon must be the only LCM on the session's etcd."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from contract import etcd_keys
from contract.etcd import EtcdClient
from services.backends.docker.spec import LABEL_JOB
from services.client.sdk import Client
from services.embedded.docker_engine import DockerEngine
from services.images.build import build_offline
from services.store import states
from tests.docker.conftest import DockerPlatform, remove_engine_root
from tests.docker.test_docker_backend import STEPPER, TERMINAL, manifest, wait_status
from tests.services.guardian.helpers import code_zip, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.docker]


@pytest.fixture()
def own_engine(learner_image: Any) -> Iterator[DockerEngine]:
    """A second engine with the learner image (imported from the cached base)."""
    data_dir = Path(tempfile.mkdtemp(prefix="rzd-", dir="/tmp"))
    engine = DockerEngine(data_dir)
    engine.start()
    try:
        client = engine.client()
        build_offline(client, lambda _line: None)
        client.close()
        yield engine
    finally:
        DockerEngine(data_dir).stop()
        engine.stop()
        remove_engine_root(data_dir)


def labelled(client: docker.DockerClient, job_id: str) -> list[str]:
    return [
        c.name for c in client.containers.list(all=True, filters={"label": f"{LABEL_JOB}={job_id}"})
    ]


def test_engine_gone_mid_deploy_fails_the_job_clearly_and_leaves_nothing(
    etcd_server: Any, mongo_server: Any, own_engine: DockerEngine, tmp_path: Path
) -> None:
    platform = DockerPlatform(tmp_path, etcd_server.url, mongo_server.url, own_engine.url)
    etcd = EtcdClient.connect(etcd_server.url)
    # The guardian pauses after recording each step as started: the engine is stopped
    # once the secrets step (which needs no engine) started, so it is gone before the
    # learners step, 2 s later (dockerd stops answering at once on SIGTERM). A delay of
    # 3 s on every step, with the engine stopped during the learners step's, spent 36 s
    # of this test in the delays.
    platform.start(
        RHIZOME_GUARDIAN_STEP_DELAY_S="1.0",
        RHIZOME_DEPLOY_ATTEMPTS="2",
        RHIZOME_LEARNER_GRACE_S="2",
    )
    engine = own_engine
    try:
        with Client(platform.address, token=platform.token()) as client:
            job_id = client.create_job(
                manifest("away", "STEPS=3 sh run.sh", learners=2), code_zip({"run.sh": STEPPER})
            ).job_id
            secrets_step = etcd_keys.deploy_step(job_id, "secrets")
            wait_for("the secrets step to start", lambda: etcd.get(secrets_step), 120)
            engine.stop()
            record = wait_status(platform, job_id, TERMINAL, 180)
            assert record.status == states.FAILED
            assert f"the Docker engine at {own_engine.url} does not answer" in record.status_message
            assert "DOCKER_HOST" in record.status_message
            # The rollbacks could not reach the engine: the job is noted for later.
            assert (tmp_path / "jobs" / ".engine-rollbacks" / job_id).exists()

            engine = DockerEngine(own_engine.data_dir)
            engine.start()
            docker_client = engine.client()
            try:
                later = client.create_job(
                    manifest("after", "STEPS=2 sh run.sh"), code_zip({"run.sh": STEPPER})
                ).job_id
                record = wait_status(platform, later, TERMINAL, 180)
                assert record.status == states.COMPLETED, record.status_message
                assert labelled(docker_client, job_id) == []
                assert not (tmp_path / "jobs" / ".engine-rollbacks" / job_id).exists()
                wait_for(
                    "no container of the later job",
                    lambda: labelled(docker_client, later) == [],
                    30,
                )
            finally:
                docker_client.close()
    finally:
        platform.stop()
        engine.stop()
        etcd.close()
