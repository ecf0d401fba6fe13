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
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


# The curve measured on the elastic runtime (benchmarks/elastic_throughput.py), shipped
# as package data so that ``throughput_model: measured`` needs nothing outside the package.
BUNDLED_THROUGHPUT_CURVE = Path(__file__).parent / "data" / "elastic_regression_throughput.json"
THROUGHPUT_CURVE_FORMAT = "rhizome.throughput-curve/1"


def fit_overhead(points: Mapping[int, float]) -> float:
    """The ``CommunicationBound`` overhead in [0, 1) that fits these speedups (learners →
    throughput relative to one learner) best in least squares. A 1-D problem: a fine grid,
    then a golden-section search around its best cell (no SciPy needed)."""

    def sse(o: float) -> float:
        return sum((s - p / (1.0 + o * (p - 1))) ** 2 for p, s in points.items())

    hi = 0.9999
    cells = 2000
    grid = [hi * i / cells for i in range(cells + 1)]
    best = min(range(len(grid)), key=lambda i: sse(grid[i]))
    a, b = grid[max(0, best - 1)], grid[min(cells, best + 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if sse(c) <= sse(d):
            b = d
        else:
            a = c
    # the bounds themselves win ties, so that linear data gives exactly 0
    return min((0.0, (a + b) / 2, hi), key=sse)


class MeasuredThroughput(ThroughputModel):
    """Throughput taken from measured runs: ``points`` maps learners to a measured
    throughput (samples/s or already relative; divided by the value at one learner, so
    ``throughput(1) == 1``). The first point must be one learner; the learners must increase.

    - Between two measured sizes: linear interpolation (so the model is monotone wherever
      the measurements are, and never overshoots them).
    - Beyond the last measured size P: the ``CommunicationBound`` shape with the overhead
      fitted to all the points (``fit_overhead``), scaled to pass through the last point:
      ``throughput(p) = T(P) · cb(p) / cb(P)``. Continuous at P, increasing, sub-linear;
      the measurement's own level is kept and only its trend is extrapolated.
    - Zero or fewer learners: 0.

    ``gain`` is the base class's ``throughput(p + 1) − throughput(p)``; with integer sizes,
    interpolation adds no points between measurements that a gain could miss."""

    def __init__(self, points: Mapping[int, float] | Sequence[tuple[int, float]]) -> None:
        pairs = list(points.items()) if isinstance(points, Mapping) else list(points)
        if not pairs:
            raise ScalingConfigError("throughput curve: no measured points; give at least p=1")
        learners: list[int] = []
        values: list[float] = []
        for p, t in pairs:
            if isinstance(p, bool) or not isinstance(p, int) or p < 1:
                raise ScalingConfigError(
                    f"throughput curve: learners={p!r}; use whole numbers >= 1"
                )
            if isinstance(t, bool) or not isinstance(t, (int, float)):
                raise ScalingConfigError(
                    f"throughput curve: throughput at p={p} is {t!r}; use a number > 0"
                )
            if not math.isfinite(t) or t <= 0:
                raise ScalingConfigError(
                    f"throughput curve: throughput at p={p} is {t!r}; it must be > 0"
                )
            if learners and p <= learners[-1]:
                raise ScalingConfigError(
                    f"throughput curve: learners must increase strictly; p={p} follows "
                    f"p={learners[-1]}"
                )
            learners.append(p)
            values.append(float(t))
        if learners[0] != 1:
            raise ScalingConfigError(
                f"throughput curve: the first point is p={learners[0]}; it must be p=1 "
                "(throughput is relative to one learner)"
            )
        base = values[0]
        self.points: tuple[tuple[int, float], ...] = tuple(
            (p, t / base) for p, t in zip(learners, values, strict=True)
        )
        self.overhead = fit_overhead(dict(self.points))
        self._tail = CommunicationBound(self.overhead)

    def __repr__(self) -> str:
        pts = ", ".join(f"{p}: {t:.3f}" for p, t in self.points)
        return f"MeasuredThroughput({{{pts}}}, fitted overhead {self.overhead:.4f})"

    def throughput(self, learners: int) -> float:
        if learners <= 0:
            return 0.0
        last_p, last_t = self.points[-1]
        if learners >= last_p:
            return last_t * self._tail.throughput(learners) / self._tail.throughput(last_p)
        for (p0, t0), (p1, t1) in zip(self.points, self.points[1:], strict=False):
            if p0 <= learners <= p1:
                return t0 + (t1 - t0) * (learners - p0) / (p1 - p0)
        raise AssertionError("unreachable: the points start at p=1")  # pragma: no cover


def load_throughput_curve(path: str | Path) -> MeasuredThroughput:
    """A ``MeasuredThroughput`` from a curve file written by
    ``benchmarks/elastic_throughput.py --write``: JSON with
    ``"format": "rhizome.throughput-curve/1"`` and
    ``"points": [{"learners": p, "samples_per_s": x}, ...]`` (the other keys describe the
    measurement). Every problem is a ``ScalingConfigError`` naming the file."""
    p = Path(path)
    try:
        doc: Any = json.loads(p.read_text())
    except OSError as exc:
        raise ScalingConfigError(f"cannot read throughput curve {p}: {exc}") from None
    except ValueError as exc:
        raise ScalingConfigError(f"throughput curve {p} is not JSON: {exc}") from None
    fmt = doc.get("format") if isinstance(doc, dict) else None
    if fmt != THROUGHPUT_CURVE_FORMAT:
        raise ScalingConfigError(
            f"throughput curve {p}: format is {fmt!r}, expected {THROUGHPUT_CURVE_FORMAT!r} "
            "(written by benchmarks/elastic_throughput.py --write)"
        )
    raw = doc.get("points")
    if not isinstance(raw, list) or not all(
        isinstance(r, dict) and "learners" in r and "samples_per_s" in r for r in raw
    ):
        raise ScalingConfigError(
            f"throughput curve {p}: 'points' must be a list of "
            "{learners: p, samples_per_s: x} objects"
        )
    try:
        return MeasuredThroughput([(r["learners"], r["samples_per_s"]) for r in raw])
    except ScalingConfigError as exc:
        raise ScalingConfigError(f"{p}: {exc}") from None


def throughput_model_from_options(
    name: str | None, overhead: float | None, curve: str | None
) -> ThroughputModel:
    """The model a scaling policy's ``throughput_model`` / ``throughput_overhead`` /
    ``throughput_curve`` options name (None: not given). ``comm-bound`` (the default) is
    ``CommunicationBound(overhead or 0.05)``; ``measured`` is the bundled curve or the
    file ``curve`` (a path, relative to the working directory); a curve implies
    ``measured``. A contradiction (a curve for ``comm-bound``, an overhead for
    ``measured``) is a ``ScalingConfigError``."""
    name = name if name is not None else ("measured" if curve is not None else "comm-bound")
    if name == "comm-bound":
        if curve is not None:
            raise ScalingConfigError(
                "throughput_curve is a measured curve; it goes with throughput_model: measured"
            )
        return CommunicationBound(0.05 if overhead is None else float(overhead))
    if name == "measured":
        if overhead is not None:
            raise ScalingConfigError(
                "throughput_overhead belongs to throughput_model: comm-bound; the measured "
                "model fits its own"
            )
        return load_throughput_curve(BUNDLED_THROUGHPUT_CURVE if curve is None else curve)
    raise ScalingConfigError(f"throughput_model={name!r}; use 'measured' or 'comm-bound'")


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
