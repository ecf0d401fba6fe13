"""Scaling policies: how the scheduler resizes running elastic jobs (issue #19).

A placement policy (``services/scheduler/placement``) decides *where* a gang goes; a
scaling policy decides *how many* learners a running elastic job (manifest
``elastic: {min, max}``) should have: fewer, to let a queued job in before anyone is
preempted, or more, to use capacity nobody waits for. It only proposes
(``ScaleDecision``); the scheduler checks every proposal against the cluster model and
the service turns it into a scale request that the job's guardian applies
(``services/guardian/elastic.py``).

The same policy object drives the daemon's scheduling loop and the simulator
(``services/scheduler/sim/elastic.py``), so the figures of the simulator are the
decisions of the service.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from services.scheduler.api import SchedulerError


class ScalingConfigError(SchedulerError, ValueError):
    """The cluster config's ``scheduler:`` section is malformed (unknown key, bad number)."""


class UnknownScalingPolicy(SchedulerError, KeyError):
    """No scaling policy is registered under that name."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class ElasticJob:
    """A running elastic job as a scaling policy sees it.

    ``learners`` is its size now (its own gang plus its scale gangs); ``attained_gpu_s``
    the GPU-seconds (or, for CPU-only jobs, learner-seconds) it has received, which puts
    it in a Tiresias queue; ``arrival`` breaks ties inside a queue (first come first).
    """

    job_id: str
    learners: int
    min_learners: int
    max_learners: int
    gpus_per_learner: int
    attained_gpu_s: float
    arrival: float = 0.0
    pool: str = "cpu"

    def service_units(self) -> int:
        """What one learner costs in the unit of ``attained_gpu_s`` (a CPU learner is 1)."""
        return max(1, self.gpus_per_learner)


@dataclass(frozen=True)
class ScaleDecision:
    """Resize ``job_id`` to ``learners``; ``reason`` goes to the job's history."""

    job_id: str
    learners: int
    reason: str


# ``fits(sizes)``: would the waiting job fit if the running jobs had these sizes?
FitsWith = Callable[[Mapping[str, int]], bool]


class ThroughputModel(abc.ABC):
    """Training throughput of a data-parallel job against its number of learners, in
    units of one learner's throughput (``throughput(1) == 1``)."""

    @abc.abstractmethod
    def throughput(self, learners: int) -> float: ...

    def gain(self, learners: int) -> float:
        """What one more learner adds."""
        return self.throughput(learners + 1) - self.throughput(learners)


@dataclass(frozen=True)
class CommunicationBound(ThroughputModel):
    """``p / (1 + overhead · (p − 1))``: every added learner adds the all-reduce's share
    ``overhead`` of a step (a data-parallel job's usual sub-linear scaling; 0 is linear)."""

    overhead: float = 0.05

    def __post_init__(self) -> None:
        if not math.isfinite(self.overhead) or not 0 <= self.overhead < 1:
            raise ScalingConfigError(
                f"throughput overhead={self.overhead!r}; use a number in [0, 1) (0: linear)"
            )

    def throughput(self, learners: int) -> float:
        if learners <= 0:
            return 0.0
        return learners / (1.0 + self.overhead * (learners - 1))


class ScalingPolicy(abc.ABC):
    """Proposes sizes for running elastic jobs. Must be deterministic."""

    name: str = ""

    @abc.abstractmethod
    def shrink(
        self,
        waiting_learners: int,
        pending: int,
        jobs: Sequence[ElasticJob],
        fits: FitsWith,
    ) -> list[ScaleDecision]:
        """A job of ``waiting_learners`` learners cannot be placed and ``pending`` jobs
        wait in its pool: which running elastic jobs (of that pool) shrink, to what, so
        that ``fits`` says it goes in. Empty when shrinking cannot admit it (then nobody
        shrinks for nothing)."""

    @abc.abstractmethod
    def grow(self, jobs: Sequence[ElasticJob], take: Callable[[str], bool]) -> list[ScaleDecision]:
        """No job waits in these jobs' pool: which grow into the idle capacity, one
        learner at a time. ``take(job_id)`` reserves room for one more learner of that job
        and says whether there was any (the caller keeps the reservations of the
        decisions it is given, and drops the others)."""


class StaticScaling(ScalingPolicy):
    """``none``: the scheduler never resizes a job by itself (the default; users still
    scale with ``rhizome scale``)."""

    name = "none"

    def shrink(
        self, waiting_learners: int, pending: int, jobs: Sequence[ElasticJob], fits: FitsWith
    ) -> list[ScaleDecision]:
        return []

    def grow(self, jobs: Sequence[ElasticJob], take: Callable[[str], bool]) -> list[ScaleDecision]:
        return []
