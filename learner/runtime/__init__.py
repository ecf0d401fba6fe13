"""Redundancy-aware pipeline runtime (Bamboo): see docs/runtime.md and ARCHITECTURE §5.

A training script describes its job and hands it over::

    from learner.runtime import PipelineJob, train
    train(PipelineJob(build_layers=..., batch=..., loss_fn=..., optimizer=..., steps=100,
                      microbatches=4))

and is started with ``python -m learner.runtime.launch --stages P --pipelines D script.py``.
"""

from learner.runtime.api import (
    ConfigError,
    Evicted,
    FatalFailure,
    Interrupted,
    LinkError,
    PipelineJob,
    Preempted,
    RedundancyMode,
    RuntimeFailure,
)
from learner.runtime.worker import train

__all__ = [
    "ConfigError",
    "Evicted",
    "FatalFailure",
    "Interrupted",
    "LinkError",
    "PipelineJob",
    "Preempted",
    "RedundancyMode",
    "RuntimeFailure",
    "train",
]
