from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from learner.runtime.api import ConfigError
from learner.runtime.partition import balanced_boundaries, param_costs, profile_costs


def test_boundaries_cover_all_layers_in_order() -> None:
    bounds = balanced_boundaries([1.0] * 7, 3)
    assert bounds[0] == 0 and bounds[-1] == 7
    assert len(bounds) == 4
    assert all(a < b for a, b in itertools.pairwise(bounds))


def test_balance_minimises_the_slowest_stage() -> None:
    costs = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    bounds = balanced_boundaries(costs, 3)
    stage_costs = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
    assert max(stage_costs) == 9.0  # [1,2,3] [4,5] [6] is optimal


def test_one_heavy_layer_gets_its_own_stage() -> None:
    bounds = balanced_boundaries([100.0, 1.0, 1.0, 1.0], 2)
    assert bounds == [0, 1, 4]


def test_more_stages_than_layers_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="3 layers but 4 stages"):
        balanced_boundaries([1.0, 1.0, 1.0], 4)


def test_param_costs_count_parameters() -> None:
    costs = param_costs([nn.Linear(3, 2), nn.Tanh()])
    assert costs == [9.0, 1.0]


def test_profile_costs_returns_one_positive_time_per_layer() -> None:
    layers = [nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)]
    costs = profile_costs(layers, torch.randn(2, 4), repeat=1)
    assert len(costs) == 3 and all(c > 0 for c in costs)
