"""A tiny deterministic job (float64 MLP on synthetic data) for tests and smoke runs."""

from __future__ import annotations

import torch
from torch import nn

from learner.runtime.api import Batch, PipelineJob, RedundancyMode


def toy_layers(width: int = 8, depth: int = 4) -> list[nn.Module]:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, 1))
    return layers


def toy_batch(step: int, pipeline: int, microbatch: int, size: int = 4, width: int = 8) -> Batch:
    g = torch.Generator().manual_seed(1_000_003 * step + 7919 * pipeline + microbatch)
    x = torch.randn(size, width, generator=g, dtype=torch.float64)
    y = x.sum(dim=1, keepdim=True).sin()
    return x, y


def toy_job(
    steps: int = 3,
    microbatches: int = 3,
    redundancy: RedundancyMode | str = RedundancyMode.EAGER_FRC_LAZY_BRC,
    depth: int = 4,
    optimizer: str = "adam",
    schedule: str = "1f1b",
) -> PipelineJob:
    def opt(params: object) -> torch.optim.Optimizer:
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # type: ignore[arg-type]
        return torch.optim.Adam(params, lr=0.01)  # type: ignore[arg-type]

    return PipelineJob(
        build_layers=lambda: toy_layers(depth=depth),
        batch=toy_batch,
        loss_fn=nn.functional.mse_loss,
        optimizer=opt,
        steps=steps,
        microbatches=microbatches,
        redundancy=RedundancyMode.parse(redundancy),
        schedule=schedule,
        seed=0,
        dtype=torch.float64,
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m learner.runtime.launch ... learner/runtime/toy.py --steps 3``."""
    import argparse

    from learner.runtime.worker import train

    p = argparse.ArgumentParser(description="toy pipeline job (float64 MLP)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=3)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    p.add_argument("--redundancy", default=RedundancyMode.EAGER_FRC_LAZY_BRC.value)
    a = p.parse_args(argv)
    train(
        toy_job(
            steps=a.steps,
            microbatches=a.microbatches,
            redundancy=a.redundancy,
            depth=a.depth,
            optimizer=a.optimizer,
        )
    )


if __name__ == "__main__":
    main()
