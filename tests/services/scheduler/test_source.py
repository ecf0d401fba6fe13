"""The cluster-source seam of the scheduler service: which source a daemon gets, and a
model rebuilt when the source's nodes change (placements kept where their nodes stay)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.config import PlatformConfig
from services.scheduler.api import ClusterConfigError, JobRequest, JobTooLarge
from services.scheduler.cluster import Cluster, Node
from services.scheduler.scheduler import GangScheduler
from services.scheduler.source import CLUSTER_SOURCES, ConfigFileSource, cluster_source


def _node(name: str, cpus: float = 4) -> Node:
    return Node(name, cpus=cpus, memory_mb=8192)


def _config(**kw: object) -> PlatformConfig:
    return replace(PlatformConfig(), **kw)  # type: ignore[arg-type]


def test_local_and_docker_backends_read_the_cluster_config() -> None:
    for backend in ("local", "docker"):
        source = cluster_source(_config(backend=backend))
        assert isinstance(source, ConfigFileSource)
        source.start(lambda: None)
        assert source.nodes() and source.version() == 0


def test_kubernetes_backend_gets_the_node_watch_and_refuses_a_cluster_config() -> None:
    assert "kubernetes" in CLUSTER_SOURCES.names()
    with pytest.raises(ClusterConfigError, match="drop --cluster-config"):
        cluster_source(_config(backend="kubernetes", cluster_config="cluster.yaml"))


def test_replace_nodes_keeps_placements_and_admits_what_now_fits() -> None:
    sched = GangScheduler(Cluster([_node("a"), _node("b")]))
    sched.submit(JobRequest("j1", learners=2, cpus=4))
    (placed,) = sched.schedule().placements
    big = JobRequest("j2", learners=1, cpus=16)
    with pytest.raises(JobTooLarge):
        sched.check(big)
    gone = sched.replace_nodes([_node("a"), _node("b"), _node("c", cpus=16)])
    assert gone == []
    sched.check(big)  # the new node takes it
    # j1 still holds its nodes in the new model: a and b are full.
    views = {v.name: v for v in sched.cluster_view().nodes}
    for name in placed.learner_nodes:
        assert views[name].cpus_free == 0
    assert views["c"].cpus_free == 16


def test_replace_nodes_reports_jobs_whose_node_left_and_refuses_an_empty_cluster() -> None:
    sched = GangScheduler(Cluster([_node("a"), _node("b")]))
    sched.submit(JobRequest("j1", learners=1, cpus=4))
    (placed,) = sched.schedule().placements
    (where,) = placed.learner_nodes
    other = "b" if where == "a" else "a"
    assert sched.replace_nodes([_node(other)]) == ["j1"]
    assert [v.name for v in sched.cluster_view().nodes] == [other]
    with pytest.raises(ClusterConfigError):
        sched.replace_nodes([])
    assert [v.name for v in sched.cluster_view().nodes] == [other]  # unchanged
    assert sched.release("j1")  # the job can still be released
