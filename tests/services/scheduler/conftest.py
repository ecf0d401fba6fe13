"""Small clusters shared by the scheduler's unit tests, and a jobs repository of a test's
own for the scheduling loop's tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from services.embedded.process import ManagedServer
from services.scheduler.cluster import Cluster, Node
from services.store.jobs import JobsRepository
from services.store.mongo import connect


def gpu_cluster(nodes: int = 4, gpus: int = 4, gpu_type: str = "V100", zones: int = 1) -> Cluster:
    return Cluster(
        [
            Node(
                f"n{i}",
                cpus=32,
                memory_mb=65536,
                gpus=gpus,
                gpu_type=gpu_type,
                zone=f"z{i % zones}",
            )
            for i in range(nodes)
        ]
    )


@pytest.fixture
def cluster4() -> Cluster:
    """4 nodes × 4 V100, one zone."""
    return gpu_cluster()


@pytest.fixture
def own_jobs(mongo_server: ManagedServer) -> Iterator[JobsRepository]:
    """A jobs repository on a database of the test's own (the loop's resync reads every
    QUEUED record in it), dropped after the test."""
    db = connect(mongo_server.url, f"sched_{uuid.uuid4().hex[:8]}")
    repo = JobsRepository(db)
    repo.ensure_indexes()
    yield repo
    db.client.drop_database(db.name)
    db.client.close()
