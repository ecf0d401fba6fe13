"""Tiresias's queues and Amoeba's Elastic-Tiresias (Amoeba §6).

Tiresias (NSDI'19) orders jobs by the service they attained (GPU-seconds), discretized
into queues: a job starts in queue 0 and moves down as it crosses each threshold
(``quanta_gpu_s``; Amoeba uses 10,000 and 200,000 GPU·s, three queues). Higher queues
go first; inside a queue, first come first served. Short jobs therefore finish without
waiting behind long ones, without knowing durations.

Elastic-Tiresias adds two rules for elastic jobs:

- **Shrink** when more than ``pending_threshold`` jobs wait: the elastic jobs *outside
  the first queue* (queue 0 holds the short jobs, about to finish) are scaled to
  ``⌊p/2⌋`` learners, never below their minimum. Here the lowest-priority job (deepest
  queue, latest arrival) goes first and only as many shrink as the waiting job needs,
  so nobody gives capacity back for nothing; if halving every candidate is not enough,
  they go on towards their minimum in the same order.
- **Grow**: capacity nobody waits for goes, one learner at a time, to the elastic job
  whose throughput gains the most from one more learner (``ThroughputModel.gain``),
  up to its maximum; ties go to the higher-priority job.

The policy also orders the scheduler's queue (``queue_key``, the ``QueueOrder`` hook of
services/scheduler/queue.py): the user's explicit ``priority`` first (higher first: an
urgent job is not held back by the service it already had), then the Tiresias queue of
the GPU·s the job attained in its earlier placements (a job preempted or halted after a
long run goes behind short new ones), then arrival. Every job, elastic or not, is ordered
so; the default policy keeps the FCFS order.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import Any

from services.scheduler.elasticity.api import (
    ElasticJob,
    FitsWith,
    ScaleDecision,
    ScalingConfigError,
    ScalingPolicy,
    ThroughputModel,
    throughput_model_from_options,
)
from services.scheduler.queue import QueueEntry, SortKey

# Amoeba §6 / Tiresias: three queues, thresholds 10,000 and 200,000 GPU·s.
DEFAULT_QUANTA_GPU_S: tuple[float, ...] = (10_000.0, 200_000.0)


def check_quanta(quanta: Sequence[float]) -> tuple[float, ...]:
    values = tuple(float(q) for q in quanta)
    if not values or any(not math.isfinite(q) or q <= 0 for q in values):
        raise ScalingConfigError(
            f"quanta_gpu_s={list(quanta)!r}; give one or more increasing numbers > 0 "
            "(GPU-seconds at which a job moves to the next queue), e.g. [10000, 200000]"
        )
    if list(values) != sorted(set(values)):
        raise ScalingConfigError(
            f"quanta_gpu_s={list(quanta)!r}: the thresholds must increase strictly"
        )
    return values


def tiresias_queue(attained_gpu_s: float, quanta: Sequence[float]) -> int:
    """The queue (0 = highest priority) of a job that attained this much service."""
    return bisect.bisect_right(list(quanta), attained_gpu_s)


def priority_key(job: ElasticJob, quanta: Sequence[float]) -> tuple[int, float, str]:
    """Tiresias order: lower queue first, then earlier arrival (then id, to be total)."""
    return (tiresias_queue(job.attained_gpu_s, quanta), job.arrival, job.job_id)


class ElasticTiresias(ScalingPolicy):
    """See the module docstring. Options (the cluster config's ``scaling_options``):
    ``quanta_gpu_s`` (queue thresholds), ``pending_threshold`` (N: shrink when more than
    N jobs wait; default 0), ``throughput_model`` (``comm-bound``, the default:
    ``CommunicationBound`` with ``throughput_overhead``, its per-learner all-reduce share,
    default 0.05; ``measured``: the curve measured on the elastic runtime, bundled with
    the package, or the one in ``throughput_curve``, a file written by
    benchmarks/elastic_throughput.py)."""

    name = "elastic-tiresias"

    def __init__(
        self,
        quanta_gpu_s: Sequence[float] = DEFAULT_QUANTA_GPU_S,
        pending_threshold: int = 0,
        throughput_overhead: float | None = None,
        model: ThroughputModel | None = None,
        throughput_model: str | None = None,
        throughput_curve: str | None = None,
    ) -> None:
        if (
            isinstance(pending_threshold, bool)
            or not isinstance(pending_threshold, int)
            or (pending_threshold < 0)
        ):
            raise ScalingConfigError(
                f"pending_threshold={pending_threshold!r}; use a whole number >= 0 "
                "(shrink when more than this many jobs wait)"
            )
        self.quanta = check_quanta(quanta_gpu_s)
        self.pending_threshold = pending_threshold
        self.model = model or throughput_model_from_options(
            throughput_model, throughput_overhead, throughput_curve
        )

    def queue_of(self, job: ElasticJob) -> int:
        return tiresias_queue(job.attained_gpu_s, self.quanta)

    # -- the queue's order (services/scheduler/queue.py, QueueOrder) ------------------------
    def queue_key(self, entry: QueueEntry) -> SortKey:
        """Priority (high first), then Tiresias queue, then arrival (then the unique seq)."""
        job = entry.job
        queue = tiresias_queue(entry.attained_gpu_s, self.quanta)
        return (-job.priority, queue, job.arrival, entry.seq)

    def queue_note(self, entry: QueueEntry) -> str:
        queue = tiresias_queue(entry.attained_gpu_s, self.quanta)
        # numbered from 0 as in the policy's shrink reasons ("queue 1 ... shrinks")
        return (
            f"Elastic-Tiresias order: queue {queue} of {len(self.quanta) + 1} (attained "
            f"{entry.attained_gpu_s:,.0f} GPU·s; queue 0 goes first, then arrival)"
        )

    def shrink(
        self, waiting_learners: int, pending: int, jobs: Sequence[ElasticJob], fits: FitsWith
    ) -> list[ScaleDecision]:
        if pending <= self.pending_threshold:
            return []
        candidates = [j for j in jobs if self.queue_of(j) > 0 and j.learners > j.min_learners]
        # lowest priority first: the deepest queue, then the latest arrival
        candidates.sort(key=lambda j: priority_key(j, self.quanta), reverse=True)
        sizes: dict[str, int] = {}
        why: dict[str, str] = {}
        for floor in ("half", "min"):
            for job in candidates:
                now = sizes.get(job.job_id, job.learners)
                target = job.min_learners if floor == "min" else max(job.min_learners, now // 2)
                if target >= now:
                    continue
                sizes[job.job_id] = target
                why[job.job_id] = (
                    f"Elastic-Tiresias: {pending} job(s) wait; queue {self.queue_of(job)} "
                    f"({job.attained_gpu_s:.0f} GPU·s attained) shrinks to make room"
                )
                if fits(sizes):
                    return [ScaleDecision(j, n, why[j]) for j, n in sizes.items()]
        return []

    def grow(self, jobs: Sequence[ElasticJob], take: Callable[[str], bool]) -> list[ScaleDecision]:
        sizes = {j.job_id: j.learners for j in jobs}
        full: set[str] = set()
        order = {j.job_id: priority_key(j, self.quanta) for j in jobs}
        while True:
            open_jobs = [
                j for j in jobs if j.job_id not in full and sizes[j.job_id] < j.max_learners
            ]
            if not open_jobs:
                break
            # the largest gain first; ties to the higher priority (the smaller key)
            best = min(
                open_jobs, key=lambda j: (-self.model.gain(sizes[j.job_id]), order[j.job_id])
            )
            if take(best.job_id):
                sizes[best.job_id] += 1
            else:
                full.add(best.job_id)
        return [
            ScaleDecision(
                j.job_id,
                sizes[j.job_id],
                f"Elastic-Tiresias: idle capacity; {j.learners} → {sizes[j.job_id]} learners "
                "(the largest throughput gain)",
            )
            for j in jobs
            if sizes[j.job_id] > j.learners
        ]


def elastic_tiresias(**options: Any) -> ElasticTiresias:
    known = {
        "quanta_gpu_s",
        "pending_threshold",
        "throughput_overhead",
        "throughput_model",
        "throughput_curve",
    }
    unknown = sorted(set(options) - known)
    if unknown:
        raise ScalingConfigError(
            f"elastic-tiresias: unknown option {unknown[0]!r}; known: {', '.join(sorted(known))}"
        )
    return ElasticTiresias(**options)
