"""The cluster simulator places jobs where the live scheduler does, for the same arrivals.

A real daemon (API + scheduler, no LCM, so placed jobs stay PENDING and keep their
nodes) on a real MongoDB-wire server and a cluster config of mixed GPU nodes; jobs are
submitted one after another through the API, each waiting for its placement. The same
jobs, with the same ids, resources and order, are then replayed through the simulator.
Every learner must land on the same node in both.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from rhizome.v1 import job_pb2

from services.client.sdk import Client
from services.daemon import Daemon
from services.embedded.process import ManagedServer
from services.scheduler.cluster import load_cluster_config
from services.scheduler.sim.engine import simulate
from services.scheduler.sim.trace import TraceJob
from tests.daemons import own_database, running_daemon
from tests.integration.conftest import token_client

pytestmark = pytest.mark.integration

CLUSTER = """\
nodes:
  - name: small
    count: 2
    cpus: 8
    memory_mb: 16384
    gpus: 2
    gpu_type: FAKE
  - name: big
    count: 2
    cpus: 8
    memory_mb: 16384
    gpus: 4
    gpu_type: FAKE
"""
# (learners, GPUs per learner), submitted in this order: 10 of the 12 GPUs, so every
# job is placed and each placement depends on the ones before it.
SHAPES = [(1, 1), (2, 1), (1, 2), (3, 1), (1, 2)]
CPUS, MEMORY_MB = 1, 512
MANIFEST = (
    "name: {name}\nlearners: {learners}\ngpus: {gpus}\ngpu_type: FAKE\n"
    f"cpus: {CPUS}\nmemory: {MEMORY_MB}\nframework: {{{{command: 'true'}}}}\n"
)


@pytest.fixture()
def cluster_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER)
    return path


@pytest.fixture()
def daemon(mongo_server: ManagedServer, tmp_path: Path, cluster_file: Path) -> Iterator[Daemon]:
    # A database of its own: reservations are cluster-wide.
    with running_daemon(
        tmp_path / "data",
        mongo_server,
        database=own_database(tmp_path),
        services=("api", "scheduler"),
        cluster_config=str(cluster_file),
    ) as d:
        yield d


def _placed(rz: Client, job_id: str, timeout_s: float = 20.0) -> tuple[str, ...]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = rz.get_job(job_id)
        if job.status == job_pb2.PENDING and job.placement.learner_nodes:
            nodes = dict(job.placement.learner_nodes)
            return tuple(nodes[rank] for rank in sorted(nodes))
        time.sleep(0.1)
    raise AssertionError(f"{job_id} was not placed within {timeout_s} s")


def test_simulated_placements_match_the_live_scheduler(daemon: Daemon, cluster_file: Path) -> None:
    live: dict[str, tuple[str, ...]] = {}
    trace: list[TraceJob] = []
    with token_client(daemon, f"x-{uuid.uuid4().hex[:6]}") as rz:
        for n, (learners, gpus) in enumerate(SHAPES):
            manifest = MANIFEST.format(name=f"job{n}", learners=learners, gpus=gpus)
            job_id = rz.create_job(manifest).job_id
            live[job_id] = _placed(rz, job_id)
            # far apart in simulated time (more than the batch window), and never
            # ending, as the live jobs never end without an LCM
            trace.append(
                TraceJob(job_id, 100.0 * n, 1e9, learners, gpus, "FAKE", "", CPUS, MEMORY_MB)
            )
    nodes = load_cluster_config(str(cluster_file)).nodes
    sim = simulate(trace, nodes, "pack", seed=0)
    assert sim.placements == live
    # the cross-check is not vacuous: the jobs spread over more than one node
    assert len({node for placed in live.values() for node in placed}) > 1
