"""An optimizer step on random gradients: what the optimizer tests step their models with.

``test_sync_buffers.py`` (the multi-tensor step against the job's own optimizer) and
``test_snapshot.py`` (a rollback to the state before an update) both need "set every
gradient from a seeded generator, step, zero the gradients"; one helper, so the two stay
the same steps.
"""

from __future__ import annotations

import torch
from torch import nn


def random_grad_step(model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    """One optimizer step with every parameter's gradient drawn from ``gen``."""
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    opt.step()
    opt.zero_grad(set_to_none=True)


def random_grad_steps(model: nn.Module, opt: torch.optim.Optimizer, seed: int, steps: int) -> None:
    """``steps`` such steps, the gradients drawn from one generator seeded ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        random_grad_step(model, opt, gen)
