"""The docker backend's recovery: the daemon and the job's guardian SIGKILLed in the middle
of a deploy. The next guardian finds the steps recorded without `complete`, removes every
container labelled with the job, and deploys again; no container is left that no active
job owns. (A module of its own: its daemon must be the only LCM on the session's etcd.)"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import docker
import pytest

from contract import etcd_keys
from contract.etcd import EtcdClient
from services.backends.docker.spec import LABEL_JOB
from services.client.sdk import Client
from services.embedded.docker_engine import DockerEngine
from services.store import states
from tests.docker.conftest import DockerPlatform
from tests.docker.test_docker_backend import (
    STEPPER,
    TERMINAL,
    containers,
    manifest,
    status,
    wait_status,
)
from tests.services.guardian.helpers import code_zip, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.docker]


def test_daemon_and_guardian_sigkilled_mid_deploy_leave_no_orphan(
    etcd_server: Any,
    mongo_server: Any,
    docker_engine: DockerEngine,
    docker_client: docker.DockerClient,
    learner_image: Any,
    tmp_path: Path,
) -> None:
    platform = DockerPlatform(tmp_path, etcd_server.url, mongo_server.url, docker_engine.url)
    etcd = EtcdClient.connect(etcd_server.url)
    platform.start(RHIZOME_GUARDIAN_STEP_DELAY_S="1.0", RHIZOME_LEARNER_GRACE_S="2")
    try:
        with Client(platform.address, token=platform.token()) as c:
            job_id = c.create_job(
                manifest("middeploy", "STEPS=5 sh run.sh", learners=2),
                code_zip({"run.sh": STEPPER}),
            ).job_id
        helper = etcd_keys.deploy_step(job_id, "helper")
        # The learners' containers exist; the helper step has started but not finished.
        wait_for("the helper step to start", lambda: etcd.get(helper), 120)
        first = {c.name for c in containers(docker_client, job_id)}
        assert len(first) == 2
        guardian = etcd.get(etcd_keys.guardian_lease(job_id))
        assert guardian is not None
        platform.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(guardian.value["pid"]), signal.SIGKILL)
        time.sleep(0.5)
        platform.start(RHIZOME_LEARNER_GRACE_S="2")
        record = wait_status(platform, job_id, TERMINAL, 180)
        assert record.status == states.COMPLETED, record.status_message
        log = (tmp_path / "jobs" / job_id / "guardian.log").read_text()
        assert "found a partial deploy" in log
        wait_for("no container of the job", lambda: containers(docker_client, job_id) == [], 30)
        # Nothing in the engine carries a label of a job that is not active any more.
        for container in docker_client.containers.list(all=True, filters={"label": LABEL_JOB}):
            owner = container.labels[LABEL_JOB]
            assert status(platform, owner).status not in TERMINAL, container.name
    finally:
        platform.stop()
        etcd.close()
