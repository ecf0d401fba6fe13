from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.api import JobRequest, UnknownPolicy
from services.scheduler.cluster import Cluster, Node
from services.scheduler.placement import get_policy, policy_names
from services.scheduler.placement import objective as obj
from tests.services.scheduler.conftest import gpu_cluster


def _fragmented(free: list[int], gpus: int = 4, zones: int = 1) -> Cluster:
    cluster = gpu_cluster(nodes=len(free), gpus=gpus, zones=zones)
    for i, f in enumerate(free):
        used = gpus - f
        if used:
            cluster.allocate(JobRequest(f"pre{i}", learners=1, gpus=used, gpu_type="V100"), [i])
    return cluster


def _fits(cluster: Cluster, job: JobRequest, learners: tuple[int, ...]) -> bool:
    counts = Counter(learners)
    return len(learners) == job.learners and all(
        cluster.gpus_free[i] >= k * job.gpus for i, k in counts.items()
    )


def _brute_force_pack(cluster: Cluster, job: JobRequest) -> float:
    cap = cluster.capacity(job)
    best = np.inf
    for counts in itertools.product(*[range(int(c) + 1) for c in cap]):
        if sum(counts) != job.learners:
            continue
        idx = np.arange(len(counts))
        best = min(best, float(obj.pack_cost(cluster, job, idx, np.array(counts))))
    return best


def test_registry_lists_builtin_policies_and_refuses_unknown_names() -> None:
    assert {"pack", "spread", "first-fit", "exact"} <= set(policy_names())
    with pytest.raises(UnknownPolicy, match="choose one of"):
        get_policy("packk")


def test_pack_keeps_the_gang_on_the_node_it_fills_exactly() -> None:
    cluster = _fragmented([4, 2, 4, 3])
    job = JobRequest("j", learners=2, gpus=1, gpu_type="V100")
    a = get_policy("pack").place(cluster, job, np.random.default_rng(0))
    assert a is not None
    assert set(a.learner_nodes) == {1}  # the node with exactly 2 free GPUs


def test_spread_puts_one_learner_per_node_on_the_emptiest_nodes() -> None:
    cluster = _fragmented([4, 2, 4, 3])
    job = JobRequest("j", learners=2, gpus=1, gpu_type="V100")
    a = get_policy("spread").place(cluster, job, np.random.default_rng(0))
    assert a is not None
    assert sorted(a.learner_nodes) == [0, 2]


def test_no_policy_places_a_gang_that_does_not_fit() -> None:
    cluster = _fragmented([1, 1, 1])
    job = JobRequest("j", learners=2, gpus=2, gpu_type="V100")
    for name in policy_names():
        assert get_policy(name).place(cluster, job, np.random.default_rng(0)) is None


def test_max_nodes_is_respected_or_the_gang_waits() -> None:
    cluster = _fragmented([2, 2, 2, 2])
    job = JobRequest("j", learners=4, gpus=1, gpu_type="V100", max_nodes=2)
    a = get_policy("pack").place(cluster, job, np.random.default_rng(0))
    assert a is not None and len(set(a.learner_nodes)) == 2
    tight = JobRequest("k", learners=4, gpus=1, gpu_type="V100", max_nodes=1)
    assert get_policy("pack").place(cluster, tight, np.random.default_rng(0)) is None


def test_zone_aware_pipeline_alternates_zones_even_when_one_node_could_hold_it() -> None:
    cluster = gpu_cluster(nodes=4, gpus=8, zones=2)
    job = JobRequest("pipe", learners=4, gpus=1, gpu_type="V100", zone_aware=True)
    a = get_policy("pack").place(cluster, job, np.random.default_rng(0))
    assert a is not None and a.zone_conflicts == 0
    zones = [cluster.nodes[i].zone for i in a.learner_nodes]
    assert all(zones[i] != zones[(i + 1) % 4] for i in range(4))
    # without the flag PACK keeps the gang on one node
    plain = JobRequest("flat", learners=4, gpus=1, gpu_type="V100")
    b = get_policy("pack").place(cluster, plain, np.random.default_rng(0))
    assert b is not None and len(set(b.learner_nodes)) == 1


@settings(max_examples=40, deadline=None)
@given(
    free=st.lists(st.integers(0, 4), min_size=1, max_size=5),
    learners=st.integers(1, 5),
    gpus=st.integers(1, 2),
)
def test_exact_policy_matches_brute_force(free: list[int], learners: int, gpus: int) -> None:
    cluster = _fragmented(free)
    job = JobRequest("j", learners=learners, gpus=gpus, gpu_type="V100")
    a = get_policy("exact").place(cluster, job, np.random.default_rng(0))
    best = _brute_force_pack(cluster, job)
    if not np.isfinite(best):
        assert a is None
        return
    assert a is not None and _fits(cluster, job, a.learner_nodes)
    assert a.cost == pytest.approx(best)


@settings(max_examples=60, deadline=None)
@given(
    free=st.lists(st.integers(0, 8), min_size=1, max_size=12),
    learners=st.integers(1, 12),
    gpus=st.integers(1, 3),
    policy=st.sampled_from(["pack", "spread", "first-fit", "exact"]),
    seed=st.integers(0, 2**16),
)
def test_every_policy_places_whole_gangs_within_free_gpus_deterministically(
    free: list[int], learners: int, gpus: int, policy: str, seed: int
) -> None:
    cluster = _fragmented(free, gpus=8, zones=2)
    job = JobRequest("j", learners=learners, gpus=gpus, gpu_type="V100")
    a = get_policy(policy).place(cluster, job, np.random.default_rng(seed))
    again = get_policy(policy).place(cluster, job, np.random.default_rng(seed))
    assert a == again
    fits_somehow = int(cluster.capacity(job).sum()) >= learners
    assert (a is not None) == fits_somehow
    if a is not None:
        assert _fits(cluster, job, a.learner_nodes)


@settings(max_examples=40, deadline=None)
@given(free=st.lists(st.integers(0, 8), min_size=2, max_size=10), learners=st.integers(1, 10))
def test_pack_is_never_worse_than_first_fit_and_never_better_than_exact(
    free: list[int], learners: int
) -> None:
    cluster = _fragmented(free, gpus=8)
    job = JobRequest("j", learners=learners, gpus=1, gpu_type="V100")
    rng = np.random.default_rng(1)
    pack = get_policy("pack").place(cluster, job, rng)
    if pack is None:
        return
    first = get_policy("first-fit").place(cluster, job, rng)
    exact = get_policy("exact").place(cluster, job, rng)
    assert first is not None and exact is not None
    assert exact.cost <= pack.cost + 1e-9
    assert pack.cost <= first.cost + 1e-9


def test_cpu_only_job_uses_cpus_as_the_packing_resource() -> None:
    cluster = Cluster([Node("a", cpus=4, memory_mb=8000), Node("b", cpus=2, memory_mb=8000)])
    job = JobRequest("j", learners=2, cpus=1, memory_mb=100)
    a = get_policy("pack").place(cluster, job, np.random.default_rng(0))
    assert a is not None and set(a.learner_nodes) == {1}  # fills b exactly
