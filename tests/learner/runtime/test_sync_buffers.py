"""The sync phase's kept buffers and optimizer choice change nothing but their cost (issue #24).

- ``prefer_foreach``: the runtime steps a job's optimizer with its multi-tensor
  implementation where the job left the choice to torch; the parameters and optimizer
  state after several steps equal the job's own optimizer's, bit for bit.
- ``BlockState.fresh_acc``: the gradient accumulators are zeroed views of one flat buffer,
  never the buffer the stash is in (a failover may still all-reduce and apply that stash
  while the next step accumulates).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from learner.runtime.worker_state import BlockState, prefer_foreach
from tests.learner.runtime._optim_steps import random_grad_steps

Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 5))


@pytest.mark.parametrize(
    "factory",
    [
        pytest.param(lambda ps: torch.optim.AdamW(ps, lr=3e-3), id="adamw"),
        pytest.param(lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1), id="adam-wd"),
        pytest.param(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), id="sgd-momentum"),
    ],
)
def test_the_foreach_step_equals_the_jobs_own_optimizer_bit_for_bit(factory: Factory) -> None:
    own, fast = _model(), _model()
    own_opt = factory(list(own.parameters()))
    fast_opt = prefer_foreach(factory(list(fast.parameters())))
    assert all(g["foreach"] is True for g in fast_opt.param_groups)
    random_grad_steps(own, own_opt, seed=7, steps=12)
    random_grad_steps(fast, fast_opt, seed=7, steps=12)
    for a, b in zip(own.parameters(), fast.parameters(), strict=True):
        assert torch.equal(a, b)
        for key, value in own_opt.state[a].items():
            assert torch.equal(value, fast_opt.state[b][key]), key


def test_a_jobs_own_choice_of_implementation_is_kept() -> None:
    params = list(_model().parameters())
    assert (
        prefer_foreach(torch.optim.AdamW(params, foreach=False)).param_groups[0]["foreach"] is False
    )
    fused = prefer_foreach(torch.optim.AdamW(params, fused=True))
    assert fused.param_groups[0]["foreach"] is None


def test_accumulators_are_zeroed_views_of_a_buffer_the_stash_is_not_in() -> None:
    model = _model()
    blk = BlockState(0, model, torch.optim.AdamW(model.parameters()))
    n = blk.numel()
    blk.fresh_acc(extra=1)
    first = blk.acc_flat
    assert first is not None and first.numel() == n + 1
    assert [a.shape for a in blk.acc] == [p.shape for p in blk.params]
    for a in blk.acc:
        a.add_(1.0)
    assert torch.equal(first[:n], torch.ones(n))  # the accumulators write into it
    # the sync phase stashes that buffer; the next step must accumulate elsewhere
    blk.stash, blk.stash_step = first, 3
    blk.fresh_acc(extra=1)
    second = blk.acc_flat
    assert second is not None and second is not first
    assert torch.equal(first[:n], torch.ones(n))  # the stash is untouched
    assert torch.count_nonzero(second) == 0
    # the step after: the stash moved to the second buffer, the first is reused, zeroed
    blk.stash = second
    blk.fresh_acc(extra=1)
    assert blk.acc_flat is first
    assert torch.count_nonzero(first) == 0
