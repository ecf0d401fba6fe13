"""Small clusters shared by the scheduler's unit tests."""

from __future__ import annotations

import pytest

from services.scheduler.cluster import Cluster, Node


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
