"""What the simulator is given: a job, prices, and a preemption model."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from services.sim.traces import Trace


class SimInputError(ValueError):
    """A simulator input is missing or out of range; the message says which and how to fix."""


def _range(name: str, value: tuple[float, float]) -> tuple[float, float]:
    lo, hi = value
    if lo < 0 or hi < lo:
        raise SimInputError(f"{name} must be a range 0 <= low <= high, got {lo}..{hi}")
    return (float(lo), float(hi))


@dataclass(frozen=True)
class JobSpec:
    """A training job as the simulator sees it (times in seconds).

    `alloc_s` is how long a replacement node takes to get, `prep_s` how long the job takes
    to be ready again on it (boot, image, rendezvous, loading the checkpoint): each a
    (low, high) range sampled uniformly.
    """

    name: str
    steps: int
    step_s: float
    save_s: float
    backup_s: float
    alloc_s: tuple[float, float] = (60.0, 300.0)
    prep_s: tuple[float, float] = (60.0, 180.0)
    stages: int = 1
    pipelines: int = 1
    samples_per_step: int = 1

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise SimInputError(f"steps must be >= 1, got {self.steps}")
        for name in ("step_s",):
            if not getattr(self, name) > 0:
                raise SimInputError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("save_s", "backup_s"):
            if getattr(self, name) < 0:
                raise SimInputError(f"{name} must be >= 0, got {getattr(self, name)}")
        object.__setattr__(self, "alloc_s", _range("alloc_s", self.alloc_s))
        object.__setattr__(self, "prep_s", _range("prep_s", self.prep_s))
        if self.stages < 1 or self.pipelines < 1:
            raise SimInputError("stages and pipelines must be >= 1")
        if self.samples_per_step < 1:
            raise SimInputError("samples_per_step must be >= 1")

    @property
    def nodes(self) -> int:
        return self.stages * self.pipelines

    @property
    def ideal_s(self) -> float:
        return self.steps * self.step_s

    @property
    def mean_restart_s(self) -> float:
        return sum(self.alloc_s) / 2 + sum(self.prep_s) / 2


@dataclass(frozen=True)
class Prices:
    """Per node-hour, in dollars."""

    on_demand_hr: float
    spot_hr: float

    def __post_init__(self) -> None:
        if self.on_demand_hr <= 0 or self.spot_hr <= 0:
            raise SimInputError("prices must be > 0 dollars per node-hour")


@dataclass(frozen=True)
class PreemptionModel:
    """Where preemptions come from: a trace (replayed from a random offset per run,
    wrapping around) or exponential node lifetimes with mean `mttp_node_s`.

    A trace removes nodes from a cluster; a removal hits the job with probability
    `job nodes / cluster nodes alive` (1 when the job is as big as the cluster). Every
    preemption comes `notice_s` after its notice (AWS gives 120 s, GCP and Azure 30 s).
    """

    notice_s: float = 120.0
    trace: Trace | None = None
    mttp_node_s: float | None = None
    name: str = field(default="")
    # Start each run at a random point of the trace (False: at its start, for tests).
    random_offset: bool = True

    def __post_init__(self) -> None:
        if (self.trace is None) == (self.mttp_node_s is None):
            raise SimInputError("give a preemption model: a trace or a node MTTP (not both)")
        if self.mttp_node_s is not None and not self.mttp_node_s > 0:
            raise SimInputError(f"mttp must be > 0 seconds, got {self.mttp_node_s}")
        if self.notice_s < 0:
            raise SimInputError(f"notice must be >= 0 seconds, got {self.notice_s}")

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.trace is not None:
            return self.trace.name
        assert self.mttp_node_s is not None
        return f"node MTTP {self.mttp_node_s / 3600:.2f} h"

    def job_rate_hr(self, nodes: int) -> float:
        """Mean preemptions per hour hitting a job of `nodes` nodes."""
        if self.mttp_node_s is not None:
            return nodes * 3600.0 / self.mttp_node_s
        assert self.trace is not None
        hits = sum(min(1.0, nodes / alive) for _t, alive in self.trace.removals_with_cluster_size())
        return hits * 3600.0 / max(self.trace.duration_s, 1.0)

    def candidates(self, rng: random.Random, nodes: int) -> Iterator[tuple[float, float]]:
        """An endless stream of (time, probability the removal hits this job)."""
        if self.mttp_node_s is not None:
            t = 0.0
            while True:
                t += rng.expovariate(nodes / self.mttp_node_s)
                yield t, 1.0
        assert self.trace is not None
        removals = self.trace.removals_with_cluster_size()
        period = max(self.trace.duration_s, 1.0)
        offset = rng.uniform(0.0, period) if self.random_offset else 0.0
        lap = 0
        while True:
            for t, alive in removals:
                at = t - offset + lap * period
                if at > 0:
                    yield at, min(1.0, nodes / alive)
            lap += 1
            if lap > 1_000_000:  # a trace whose removals are all at t=0 must not spin
                return


def expected_notice_fits(job: JobSpec, notice_s: float) -> bool:
    return job.step_s + job.save_s + job.backup_s < notice_s


def finite(x: float) -> bool:
    return math.isfinite(x)
