"""A pipeline job on the docker backend: `rhizomed --backend docker` on the session's real
engine, each learner a container running one worker of the pipeline runtime, the
rendezvous store in the platform's etcd. A learner container killed with `docker kill`
(a node's preemption: the controller dies with the worker) is the runtime's failover,
not a restart: the restarted controller reports the vanished worker as KILLED, the
guardian records the failover in the history, keeps the job PROCESSING and starts a
replacement, and the job completes with the parameters of the uninterrupted run."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import docker
import pytest
from rhizome.v1 import tds_pb2

from services.backends.docker.spec import LABEL_RANK
from services.client.sdk import Client
from services.store import states
from tests.docker.conftest import DockerPlatform
from tests.docker.test_docker_backend import (
    TERMINAL,
    containers,
    jobs,
    status,
    wait_status,
)
from tests.learner.runtime.test_failover import assert_equals_reference
from tests.services.guardian.helpers import code_zip, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.docker]

SCRIPT = "from learner.runtime.toy import main\n\nmain()\n"
STEPS = 60


@pytest.fixture(scope="module")
def client(docker_platform: DockerPlatform) -> Any:
    with Client(docker_platform.address, token=docker_platform.token()) as c:
        yield c


def learner_file(platform: DockerPlatform, job_id: str, rank: int, name: str) -> str:
    """A learner's `stdout.log`/`stderr.log` as the local backend would write it: on docker
    the container's stream, as the job's log collector shipped it to the TDS."""
    return platform.learner_output(job_id, rank, stream=name.removesuffix(".log"))


def test_a_pipeline_job_in_containers_survives_a_docker_kill_of_a_learner(
    docker_platform: DockerPlatform,
    client: Client,
    docker_client: docker.DockerClient,
    tmp_path: Path,
) -> None:
    text = (
        "name: pipe-docker\nmemory: 1GiB\ncpus: 1\nmax_learner_restarts: 2\n"
        # the gate holds step 30 until the replacement of learner 1 has joined
        f"framework:\n  command: python train.py --steps {STEPS} --gate 30:2\n"
        "pipeline: {stages: 2, pipelines: 1}\n"
    )
    job_id = client.create_job(text, code_zip({"train.py": SCRIPT})).job_id
    wait_for(
        "learner 1 at step 3",
        lambda: "step 3 " in learner_file(docker_platform, job_id, 1, "stdout.log"),
        240,
    )
    victims = [
        c for c in containers(docker_client, job_id, all=False) if c.labels.get(LABEL_RANK) == "1"
    ]
    assert len(victims) == 1, [(c.name, c.labels) for c in containers(docker_client, job_id)]
    victims[0].kill()  # `docker kill`: the worker and its controller, as a preemption
    expected = "learner 1 preempted; stage 1 now served by learner 0 (generation 1)"
    wait_for(
        "the failover in the history",
        lambda: any(h.message == expected for h in status(docker_platform, job_id).history),
        120,
    )
    record = wait_status(docker_platform, job_id, TERMINAL, timeout=300)
    assert record.status == states.COMPLETED, (record.status_message, record.last_log_lines)
    messages = [h.message for h in record.history]
    statuses = [h.status for h in record.history]
    # the runtime failed over and a replacement joined; the job was never restarted
    assert "learner 1 lost: a replacement joins as a standby (replacement 1 of at most 2)" in (
        messages
    ), messages
    assert statuses.count(states.DEPLOYING) == 1, statuses
    assert states.RECOVERING not in statuses and states.FAILED not in statuses, statuses
    err0 = learner_file(docker_platform, job_id, 0, "stderr.log")
    assert "promoted replica of block 1" in err0, err0
    err1 = learner_file(docker_platform, job_id, 1, "stderr.log")
    assert "received block 1 at version" in err1, err1
    assert f"[worker 1] finished: {STEPS} steps, blocks [1] of pipeline 0" in err1, err1
    # every worker's parameters (results/<job>/<rank>/worker<rank>.pt) together equal the
    # single-process reference run of the same seed
    params = tmp_path / "params"
    params.mkdir()
    results = docker_platform.data_dir / "objects" / "results" / job_id
    saved = sorted(results.glob("*/worker*.pt"))
    assert [f"{f.parent.name}/{f.name}" for f in saved] == ["0/worker0.pt", "1/worker1.pt"]
    for f in saved:
        shutil.copy(f, params / f.name)
    assert_equals_reference(params, pipelines=1, steps=STEPS)
    # each stage's per-step metrics left its container through the platform's metric path
    # (contract/runtime_metrics.py); learner 0's generation rose with the failover
    samples = list(client.metrics(tds_pb2.MetricsRequest(job_id=job_id, learner=-1)))
    generations = {s.value for s in samples if s.learner == 0 and s.name == "runtime/generation"}
    assert 0 in generations and max(generations) >= 1, sorted(generations)
    assert {s.learner for s in samples if s.name == "runtime/frc_bubble_ms"} == {0, 1}
    wait_for("no container after the end", lambda: containers(docker_client, job_id) == [], 60)
    assert jobs(docker_platform).get(job_id).status == states.COMPLETED
