"""Split a sequence of layers into P contiguous stages of balanced cost.

Cost is profiled forward+backward time per layer (``balance="time"``) or the parameter
count (``balance="params"``, deterministic). The split minimises the most expensive
stage (the pipeline's throughput is set by its slowest stage) by binary search over the
bottleneck, as in torchgpipe's ``balance_by_time``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from learner.runtime.api import ConfigError


def param_costs(layers: Sequence[nn.Module]) -> list[float]:
    # A parameter-free layer (activation, reshape) still costs something to run.
    return [float(sum(p.numel() for p in layer.parameters())) + 1.0 for layer in layers]


def profile_costs(
    layers: Sequence[nn.Module], sample: torch.Tensor, repeat: int = 3
) -> list[float]:
    costs = [0.0] * len(layers)
    for _ in range(repeat):
        x = sample.detach()
        for i, layer in enumerate(layers):
            x = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            y = layer(x)
            if y.requires_grad:
                y.sum().backward()
            costs[i] += time.perf_counter() - t0
            x = y
    return costs


def balanced_boundaries(costs: Sequence[float], stages: int) -> list[int]:
    """Start indices of each stage plus the end: ``[0, b1, ..., len(costs)]``."""
    n = len(costs)
    if stages < 1:
        raise ConfigError(f"stages={stages}: must be >= 1")
    if n < stages:
        raise ConfigError(
            f"the model has {n} layers but {stages} stages were asked for: "
            "use fewer stages or split the model into more layers"
        )

    def split(limit: float) -> list[int] | None:
        bounds = [0]
        acc = 0.0
        for i, c in enumerate(costs):
            if c > limit:
                return None
            stages_not_started = stages - len(bounds)
            if acc > 0 and (acc + c > limit or n - i == stages_not_started):
                if stages_not_started == 0:
                    return None
                bounds.append(i)
                acc = 0.0
            acc += c
        bounds.append(n)
        return bounds if len(bounds) == stages + 1 else None

    lo, hi = max(costs), float(sum(costs))
    best = split(hi)
    for _ in range(60):
        mid = (lo + hi) / 2
        got = split(mid)
        if got is not None:
            best, hi = got, mid
        else:
            lo = mid
    if best is None:  # pragma: no cover - split(sum) always succeeds when n >= stages
        raise ConfigError("could not partition the model")
    return best
