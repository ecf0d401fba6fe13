"""A job's cost so far (held node-hours × the cluster config's prices) and the spot
simulator's estimate to finish (services/client/cost.py), and the cluster config's
`price_per_hour`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.client.cost import cost_so_far, estimate_to_finish, held_seconds, steps_done
from services.scheduler.api import ClusterConfigError
from services.scheduler.cluster import load_cluster_config, nodes_from_config

REPO = Path(__file__).resolve().parents[3]
MNIST = yaml.safe_load((REPO / "examples/mnist/manifest.yml").read_text())


def test_held_time_counts_only_the_states_that_hold_nodes() -> None:
    history = [
        ("QUEUED", 0.0),
        ("PENDING", 100.0),  # placed: nodes held from here
        ("PROCESSING", 150.0),
        ("HALTED", 400.0),  # released
        ("QUEUED", 500.0),
        ("PENDING", 1000.0),  # held again, still running at `now`
        ("PROCESSING", 1010.0),
    ]
    assert held_seconds(history, now=1600.0) == 300.0 + 600.0


def test_cost_so_far_prices_each_distinct_node_and_names_the_unpriced_ones() -> None:
    history = [("QUEUED", 0.0), ("PENDING", 0.0), ("COMPLETED", 7200.0)]  # two hours
    cost = cost_so_far(history, ["gpu-a", "gpu-a", "cpu-0"], {"gpu-a": 0.9, "cpu-0": 0.0}, 9e9)
    assert cost.held_hours == 2.0
    assert cost.node_hours == 4.0  # two distinct nodes
    assert cost.dollars == pytest.approx(1.8)
    assert cost.unpriced == ["cpu-0"]


def test_steps_done_is_the_newest_step_reported() -> None:
    assert steps_done([{"step": 3}, {"step": 7}], [{"step": 5}]) == 7
    assert steps_done([], []) == 0


def test_the_estimate_to_finish_simulates_the_steps_left_of_the_manifest() -> None:
    early = estimate_to_finish(MNIST, done=2)
    late = estimate_to_finish(MNIST, done=8)
    assert not early.problem and not late.problem
    assert (early.steps_done, early.steps_total) == (2, 10)
    assert early.strategy == "adaptive" and "aws-p3-64" in early.model
    # Fewer steps left cost less and take less time.
    assert 0 < late.dollars < early.dollars
    assert 0 < late.hours < early.hours
    assert estimate_to_finish(MNIST, done=10).dollars == 0.0


def test_a_manifest_without_an_estimate_section_says_what_to_add() -> None:
    bare = {k: v for k, v in MNIST.items() if k != "estimate"}
    found = estimate_to_finish(bare, done=0)
    assert "estimate.steps" in found.problem


def test_the_cluster_config_takes_a_price_per_node_hour_defaulting_to_unpriced() -> None:
    nodes = nodes_from_config(
        {
            "nodes": [
                {"name": "a", "cpus": 1, "memory_mb": 1, "price_per_hour": 0.5},
                {"name": "b", "cpus": 1, "memory_mb": 1},
            ]
        }
    )
    assert [n.price_per_hour for n in nodes] == [0.5, 0.0]
    with pytest.raises(ClusterConfigError, match="price_per_hour=-1"):
        nodes_from_config(
            {"nodes": [{"name": "a", "cpus": 1, "memory_mb": 1, "price_per_hour": -1}]}
        )
    views = load_cluster_config(REPO / "deploy/cluster-local.yaml").node_views()
    assert all(v.price_per_hour > 0 for v in views)
