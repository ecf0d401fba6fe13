"""Single-process reference training: what a pipeline run must end with (allclose).

Same layers (same seed), same microbatches, the loss of each microbatch scaled by
``1 / (microbatches * pipelines)`` and gradients summed: the global batch of a step is
all pipelines' microbatches, exactly as the pipeline runtime trains. ``grow_at``: the
job grew (reconfigure.py) — from step ``s`` on it has ``grow_at[s]`` pipelines, and the
new pipeline's microbatches join the global batch.
"""

from __future__ import annotations

import torch
from torch import nn

from learner.runtime.api import PipelineJob


def pipelines_at(step: int, pipelines: int, grow_at: dict[int, int] | None) -> int:
    """The number of pipelines training step ``step``."""
    for start, count in sorted((grow_at or {}).items()):
        if step >= start:
            pipelines = count
    return pipelines


def reference_train(
    job: PipelineJob,
    pipelines: int,
    steps: int | None = None,
    grow_at: dict[int, int] | None = None,
) -> dict[str, torch.Tensor]:
    torch.manual_seed(job.seed)
    model = nn.Sequential(*[layer.to(dtype=job.dtype) for layer in job.build_layers()])
    opt = job.optimizer(model.parameters())
    for step in range(job.steps if steps is None else steps):
        d_count = pipelines_at(step, pipelines, grow_at)
        scale = 1.0 / (job.microbatches * d_count)
        for d in range(d_count):
            for m in range(job.microbatches):
                x, y = job.batch(step, d, m)
                if x.is_floating_point():
                    x = x.to(dtype=job.dtype)
                (job.loss_fn(model(x), y) * scale).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
