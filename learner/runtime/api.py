"""Public types of the pipeline runtime: redundancy modes, the job a script describes, errors.

Modelled on torch.distributed.elastic's ``api.py``: the abstract pieces and the typed
exceptions live here so that backends and the engine depend on this module only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from contract.status import ExitCode


class RedundancyMode(enum.StrEnum):
    """How a stage keeps its successor's layers ready (Bamboo §4).

    ``none``: no replica; any failure is fatal.
    ``lazy-frc-lazy-brc``: the replica is kept up to date but only run after a failure.
    ``eager-frc-lazy-brc`` (default): the replica's forward runs in the bubble every
    microbatch; its backward (BRC) only after a failure.
    ``eager-frc-eager-brc``: forward and backward of the replica run every microbatch.
    """

    NONE = "none"
    LAZY_FRC_LAZY_BRC = "lazy-frc-lazy-brc"
    EAGER_FRC_LAZY_BRC = "eager-frc-lazy-brc"
    EAGER_FRC_EAGER_BRC = "eager-frc-eager-brc"

    @property
    def has_replica(self) -> bool:
        return self is not RedundancyMode.NONE

    @property
    def eager_frc(self) -> bool:
        return self in (RedundancyMode.EAGER_FRC_LAZY_BRC, RedundancyMode.EAGER_FRC_EAGER_BRC)

    @property
    def eager_brc(self) -> bool:
        return self is RedundancyMode.EAGER_FRC_EAGER_BRC

    @classmethod
    def parse(cls, value: str | RedundancyMode) -> RedundancyMode:
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(m.value for m in cls)
            raise ConfigError(
                f"redundancy mode {value!r} is unknown; use one of: {known}"
            ) from None


Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class PipelineJob:
    """What a training script hands to the runtime.

    ``build_layers`` must be deterministic under ``torch.manual_seed(seed)``: every worker
    builds the same layers and keeps its own slice. ``batch(step, pipeline, microbatch)``
    returns ``(inputs, targets)`` of one microbatch; the global batch of a step is all
    pipelines' microbatches, and the loss of a step is their mean.
    """

    build_layers: Callable[[], Sequence[nn.Module]]
    batch: Callable[[int, int, int], Batch]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    steps: int
    microbatches: int
    redundancy: RedundancyMode = RedundancyMode.EAGER_FRC_LAZY_BRC
    schedule: str = "1f1b"
    seed: int = 0
    dtype: torch.dtype = torch.float32
    balance: str = "params"
    on_fatal: Callable[[FatalFailure], None] | None = None

    def validate(self, stages: int) -> None:
        if self.steps < 0:
            raise ConfigError(f"steps={self.steps}: must be >= 0")
        if not 1 <= self.microbatches <= 255:
            raise ConfigError(f"microbatches={self.microbatches}: must be between 1 and 255")
        if self.schedule not in ("1f1b", "gpipe"):
            raise ConfigError(f"schedule={self.schedule!r}: use '1f1b' or 'gpipe'")
        if self.balance not in ("params", "time"):
            raise ConfigError(f"balance={self.balance!r}: use 'params' or 'time'")
        if stages < 1 or stages > 64:
            raise ConfigError(f"stages={stages}: must be between 1 and 64")
        self.redundancy = RedundancyMode.parse(self.redundancy)


class RuntimeFailure(Exception):
    """Base of every error the runtime raises on purpose."""


class ConfigError(RuntimeFailure, ValueError):
    """Bad input: the message names the value and how to fix it."""


class LinkError(RuntimeFailure):
    """A send/recv with ``peer`` raised or timed out."""

    def __init__(self, peer: int, reason: str) -> None:
        super().__init__(f"link to worker {peer} failed: {reason}")
        self.peer = peer
        self.reason = reason


class Interrupted(RuntimeFailure):
    """The configuration generation moved on while this worker was waiting."""


class Evicted(RuntimeFailure):
    """The cluster state declares this worker dead (it was too slow or partitioned)."""


class FatalFailure(RuntimeFailure):
    """No shadow is left for a lost stage: the job must restart from a checkpoint."""

    def __init__(self, message: str, pipeline: int = -1, lost_stages: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.pipeline = pipeline
        self.lost_stages = tuple(lost_stages)


class Preempted(RuntimeFailure):
    """This worker left on a preemption notice (learner/runtime/halt.py): after the
    emergency block save of a halt, or alone at a step boundary (its peers fail over)."""


# A worker's exit code, read by the launcher (and, through it, by the platform).
EXIT_FATAL = ExitCode.FATAL
EXIT_EVICTED = ExitCode.EVICTED
EXIT_PREEMPTED = ExitCode.PREEMPTED
