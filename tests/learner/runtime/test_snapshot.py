"""The pre-update snapshot restores parameters and optimizer state exactly, buffers reused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from learner.runtime.snapshot import OptimizerSnapshot
from tests.learner.runtime._optim_steps import random_grad_steps

Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    random_grad_steps(model, opt, seed, steps=1)


@pytest.mark.parametrize(
    "factory",
    [
        pytest.param(lambda ps: torch.optim.AdamW(ps, lr=1e-2), id="adamw"),
        pytest.param(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), id="sgd-momentum"),
    ],
)
def test_restore_returns_to_the_state_before_the_update(factory: Factory) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).double()
    opt = factory(list(model.parameters()))
    snap = OptimizerSnapshot()
    snap.take(list(model.parameters()), opt)  # before any state exists
    _step(model, opt, 1)
    snap.restore(list(model.parameters()), opt)
    assert all(not opt.state[p] for p in model.parameters())
    _step(model, opt, 1)
    _step(model, opt, 2)
    snap.take(list(model.parameters()), opt)
    buffers = [t.data_ptr() for t in snap.params]
    expected = [p.detach().clone() for p in model.parameters()]
    _step(model, opt, 3)
    snap.restore(list(model.parameters()), opt)
    for p, e in zip(model.parameters(), expected, strict=True):
        assert torch.equal(p, e)
    # the same update after the rollback gives the same result as the first time
    _step(model, opt, 3)
    again = [p.detach().clone() for p in model.parameters()]
    snap.restore(list(model.parameters()), opt)
    _step(model, opt, 3)
    for p, a in zip(model.parameters(), again, strict=True):
        assert torch.equal(p, a)
    snap.take(list(model.parameters()), opt)
    assert [t.data_ptr() for t in snap.params] == buffers  # no new allocation
