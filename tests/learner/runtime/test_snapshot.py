"""The pre-update snapshot restores parameters and optimizer state exactly, buffers reused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from learner.runtime.snapshot import OptimizerSnapshot
from learner.runtime.worker_state import BlockState
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


def _block(seed: int = 0) -> BlockState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).double()
    return BlockState(0, model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _reduced(blk: BlockState, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(blk.numel(), generator=g, dtype=torch.float64)


def _state(blk: BlockState) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in blk.params]
    for p in blk.params:
        out += [v.clone() for v in blk.optimizer.state[p].values()]
    return out


def test_a_snapshot_prepared_ahead_is_the_one_apply_would_take() -> None:
    """``prepare_snapshot`` (on the updater's thread, in a wait of the step) then ``apply``:
    the same parameters, optimizer state and rollback as the snapshot taken inside
    ``apply``, bit for bit, and the buffers alternate rather than grow."""
    ahead, inline = _block(), _block()
    for step in range(4):
        before = _state(ahead)
        ahead.prepare_snapshot()
        ahead.apply(_reduced(ahead, step), step)
        inline.apply(_reduced(inline, step), step)
        assert all(torch.equal(a, b) for a, b in zip(_state(ahead), _state(inline), strict=True))
        assert ahead.last_apply_s[0] < inline.last_apply_s[0] or step == 0
    assert ahead.snapshot is not None
    ahead.snapshot.restore(ahead.params, ahead.optimizer)
    assert all(torch.equal(a, b) for a, b in zip(_state(ahead), before, strict=True))
    assert ahead._prepared is not None and ahead._prepared is not ahead.snapshot


def test_a_prepared_snapshot_of_a_replaced_state_is_not_used() -> None:
    """A load or a hand-over replaces the state outside ``apply``, at the same version: a
    snapshot prepared before it is dropped (``drop_prepared``), so the rollback after the
    next update returns to the loaded state, not to the one before the load."""
    blk, other = _block(0), _block(1)
    blk.apply(_reduced(blk, 0), 0)
    other.apply(_reduced(other, 0), 0)
    blk.prepare_snapshot()  # of version 1
    # what block_checkpoint.load and the hand-over do: another state, the same version
    blk.module.load_state_dict(other.module.state_dict())
    blk.optimizer.load_state_dict(other.optimizer.state_dict())
    blk.drop_prepared()
    loaded = _state(blk)
    blk.prepare_snapshot()  # taken again, of the loaded state
    blk.apply(_reduced(blk, 1), 1)
    assert blk.snapshot is not None
    blk.snapshot.restore(blk.params, blk.optimizer)
    assert all(torch.equal(a, b) for a, b in zip(_state(blk), loaded, strict=True))
    # and without a prepared one, apply copies as before
    blk.version = 1
    blk.apply(_reduced(blk, 1), 1)
    blk.snapshot.restore(blk.params, blk.optimizer)
    assert all(torch.equal(a, b) for a, b in zip(_state(blk), loaded, strict=True))
