from __future__ import annotations

from pathlib import Path

import pytest

from services.scheduler.api import ClusterConfigError, JobRequest, OverCommitError, UnknownGpuType
from services.scheduler.cluster import Cluster, Node, load_cluster_config, nodes_from_config

REPO = Path(__file__).resolve().parents[3]


def test_local_config_describes_one_machine_as_virtual_nodes() -> None:
    cluster = load_cluster_config(REPO / "deploy" / "cluster-local.yaml")
    names = [n.name for n in cluster.nodes]
    assert names[:4] == [f"local-cpu-{i}" for i in range(4)]
    assert cluster.gpu_types == ["FAKE"]
    assert set(cluster.zones) == {"local-a", "local-b"}


def test_count_expands_into_numbered_nodes() -> None:
    nodes = nodes_from_config(
        {
            "nodes": [
                {"name": "k80", "count": 3, "cpus": 8, "memory_mb": 1, "gpus": 4, "gpu_type": "K80"}
            ]
        }
    )
    assert [n.name for n in nodes] == ["k80-0", "k80-1", "k80-2"]
    assert all(n.gpus == 4 and n.gpu_type == "K80" for n in nodes)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"nodes": [{"name": "a", "cpus": 1, "memory_mb": 1, "gpu": 2}]}, "did you mean 'gpus'"),
        ({"node": []}, "did you mean 'nodes'"),
        ({"nodes": [{"name": "a", "cpus": 1, "memory_mb": 1, "gpus": 2}]}, "no 'gpu_type'"),
        ({"nodes": [{"name": "a", "cpus": -1, "memory_mb": 1}]}, "cpus=-1"),
        ({"nodes": [{"name": "a", "memory_mb": 1}]}, "missing 'cpus'"),
        (
            {"nodes": [{"name": "a", "cpus": 1, "memory_mb": 1, "gpus": 1.5, "gpu_type": "X"}]},
            "whole number",
        ),
        ({"nodes": []}, "non-empty list"),
    ],
)
def test_bad_cluster_config_names_the_problem(config: dict[str, object], message: str) -> None:
    with pytest.raises(ClusterConfigError, match=message):
        Cluster(nodes_from_config(config))


def test_duplicate_node_names_are_refused() -> None:
    with pytest.raises(ClusterConfigError, match="duplicate node names: a"):
        Cluster([Node("a", 1, 1), Node("a", 1, 1)])


def test_unreadable_or_invalid_yaml_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ClusterConfigError, match="cannot read"):
        load_cluster_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [\n")
    with pytest.raises(ClusterConfigError, match="not valid YAML"):
        load_cluster_config(bad)


def test_capacity_counts_learners_by_the_scarcest_resource() -> None:
    cluster = Cluster(
        [
            Node("a", cpus=4, memory_mb=100, gpus=4, gpu_type="V100"),
            Node("b", cpus=32, memory_mb=1000, gpus=8, gpu_type="V100"),
            Node("c", cpus=32, memory_mb=1000, gpus=8, gpu_type="K80"),
        ]
    )
    job = JobRequest("j", learners=10, gpus=2, gpu_type="V100", cpus=3, memory_mb=50)
    assert cluster.capacity(job).tolist() == [1, 4, 0]


def test_unknown_gpu_type_suggests_the_close_one(cluster4: Cluster) -> None:
    with pytest.raises(UnknownGpuType, match="did you mean V100"):
        cluster4.check_gpu_type(JobRequest("j", learners=1, gpus=1, gpu_type="v100"))


def test_allocation_beyond_free_gpus_is_refused_and_changes_nothing(cluster4: Cluster) -> None:
    job = JobRequest("j", learners=2, gpus=3, gpu_type="V100")
    with pytest.raises(OverCommitError):
        cluster4.allocate(job, [0, 0])
    assert cluster4.gpus_free.tolist() == [4, 4, 4, 4]
    cluster4.allocate(job, [0, 1])
    assert cluster4.gpus_free.tolist() == [1, 1, 4, 4]
    assert cluster4.release("j") is not None
    assert cluster4.gpus_free.tolist() == [4, 4, 4, 4]
