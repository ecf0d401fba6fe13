"""Tiresias vs Elastic-Tiresias on one GPU pool (Amoeba §6, issue #19).

A time-stepped replay of a job trace against ``gpus`` GPUs, one GPU per learner (the
pool model: which node a learner lands on is the placement policies' business and is
simulated in ``engine.py``; here only how many GPUs each job holds matters). Every
``step_s`` the policy decides each active job's size:

- **Tiresias** (discretized 2D-LAS): active jobs in order of their queue (attained
  GPU·s against ``quanta_gpu_s``), then arrival; each runs at its requested size if that
  fits in what is left, else waits (a running job that no longer fits is preempted).
- **Elastic-Tiresias**: the same order, every job elastic between ``min`` and ``max``
  learners; a running job keeps at most its requested size while others wait, may run on
  what is left down to its minimum; for each job still waiting the *service's* policy
  object (``ElasticTiresias.shrink``) says which jobs outside the first queue shrink to
  admit it; capacity left when nobody waits goes through ``ElasticTiresias.grow``.

A job's work is its duration at its requested size times the throughput of that size
(``ThroughputModel``), so a job run wider or narrower finishes sooner or later by the
model. ``compare`` takes the model by name (``throughput_model``): ``measured`` (the
default) is the curve measured on Rhizome's elastic runtime
(``services/scheduler/elasticity/data/elastic_regression_throughput.json``, written by
``benchmarks/elastic_throughput.py``; or another such file), ``comm-bound`` is
``p / (1 + overhead (p − 1))`` with a chosen overhead. A size change of a running elastic job stalls it ``rescale_s``; a job started
again after a preemption loses ``restart_s`` (stop-resume: reload from a checkpoint).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from services.scheduler.elasticity.api import (
    BUNDLED_THROUGHPUT_CURVE,
    CommunicationBound,
    ElasticJob,
    FitsWith,
    MeasuredThroughput,
    ThroughputModel,
    load_throughput_curve,
)
from services.scheduler.elasticity.tiresias import (
    DEFAULT_QUANTA_GPU_S,
    ElasticTiresias,
    tiresias_queue,
)

TIRESIAS = "tiresias"
ELASTIC_TIRESIAS = "elastic-tiresias"
POLICIES = (TIRESIAS, ELASTIC_TIRESIAS)
MEASURED = "measured"
COMM_BOUND = "comm-bound"
THROUGHPUT_MODELS = (MEASURED, COMM_BOUND)
# Amoeba's measured stalls are about 1.1 s out and ~0 in; Rhizome measured 0.05 s
# (benchmarks/RESULTS.md). The larger figure is taken, to favour the baseline.
DEFAULT_RESCALE_S = 1.1
# A stop-resume through the platform took 26-29 s for a tiny model (RESULTS.md,
# elastic_scaling); a real model's checkpoint load makes it longer.
DEFAULT_RESTART_S = 30.0
# Per-size JCT buckets of Amoeba's Table 2 shape: requested GPUs.
SIZE_BUCKETS: tuple[tuple[str, int, int], ...] = (
    ("1 GPU", 1, 1),
    ("2-4 GPUs", 2, 4),
    ("8 GPUs", 5, 8),
    (">=16 GPUs", 9, 1 << 30),
)


@dataclass(frozen=True)
class ElasticTraceJob:
    job_id: str
    arrival_s: float
    duration_s: float  # at its requested size
    gpus: int  # requested learners (one GPU each)
    min_gpus: int = 1
    max_gpus: int = 0  # 0: twice the request


def philly_like_trace(
    seed: int, jobs: int = 480, cluster_gpus: int = 64, load: float = 1.0
) -> list[ElasticTraceJob]:
    """Job sizes and durations drawn in the shape Microsoft's Philly trace has (Jeon et
    al., ATC'19, as Tiresias and Amoeba use it): most jobs take one GPU, few take 16 or
    more; durations are heavy-tailed (log-normal, median 20 min, capped at 2 days).
    Poisson arrivals at an offered ``load`` of the cluster. Elastic bounds: 1 learner
    up to twice the request."""
    rng = np.random.default_rng(seed)
    sizes = np.array([1, 2, 4, 8, 16, 32])
    probs = np.array([0.55, 0.12, 0.15, 0.12, 0.04, 0.02])
    median_s, sigma, cap = 1200.0, 1.6, 48 * 3600.0
    draws = np.minimum(rng.lognormal(np.log(median_s), sigma, 50_000), cap)
    mean_demand = float(np.dot(sizes, probs)) * float(draws.mean())
    rate = load * cluster_gpus / mean_demand  # jobs per second
    out: list[ElasticTraceJob] = []
    t = 0.0
    for n in range(jobs):
        t += float(rng.exponential(1.0 / rate))
        gpus = int(rng.choice(sizes, p=probs))
        gpus = min(gpus, cluster_gpus)
        duration = float(min(rng.lognormal(np.log(median_s), sigma), cap))
        out.append(
            ElasticTraceJob(f"job-{n:04d}", t, duration, gpus, 1, min(2 * gpus, cluster_gpus))
        )
    return out


@dataclass
class _Job:
    spec: ElasticTraceJob
    work: float  # remaining, in one-learner-seconds
    size: int = 0
    attained: float = 0.0
    started: bool = False
    end: float | None = None

    @property
    def max_gpus(self) -> int:
        return self.spec.max_gpus or 2 * self.spec.gpus


@dataclass
class ElasticSimResult:
    policy: str
    jobs: int
    completed: int
    jct_s: dict[str, float] = field(repr=False)  # job id -> JCT
    sizes: dict[str, int] = field(repr=False)  # job id -> requested GPUs
    busy_gpu_s: float = 0.0
    makespan_s: float = 0.0
    gpus: int = 0
    rescales: int = 0
    preemptions: int = 0

    @property
    def utilization(self) -> float:
        return self.busy_gpu_s / (self.gpus * self.makespan_s) if self.makespan_s else 0.0

    def jct_mean_s(self, lo: int = 1, hi: int = 1 << 30) -> float:
        values = [v for j, v in self.jct_s.items() if lo <= self.sizes[j] <= hi]
        return float(np.mean(values)) if values else math.nan

    def jct_p99_s(self) -> float:
        return float(np.percentile(list(self.jct_s.values()), 99)) if self.jct_s else math.nan


def simulate_elastic(
    trace: Sequence[ElasticTraceJob],
    gpus: int,
    policy: str,
    *,
    model: ThroughputModel | None = None,
    quanta_gpu_s: Sequence[float] = DEFAULT_QUANTA_GPU_S,
    pending_threshold: int = 0,
    step_s: float = 60.0,
    rescale_s: float = DEFAULT_RESCALE_S,
    restart_s: float = DEFAULT_RESTART_S,
    horizon_s: float = 60 * 24 * 3600.0,
) -> ElasticSimResult:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    et = ElasticTiresias(quanta_gpu_s, pending_threshold, model=model)
    tput = et.model
    quanta = et.quanta
    jobs = {
        j.job_id: _Job(j, work=j.duration_s * tput.throughput(min(j.gpus, gpus)))
        for j in sorted(trace, key=lambda j: j.arrival_s)
    }
    order = list(jobs.values())
    result = ElasticSimResult(
        policy, len(jobs), 0, {}, {j.job_id: j.gpus for j in trace}, gpus=gpus
    )
    elastic = policy == ELASTIC_TIRESIAS
    now = 0.0
    next_arrival = 0
    active: list[_Job] = []
    while (next_arrival < len(order) or active) and now < horizon_s:
        while next_arrival < len(order) and order[next_arrival].spec.arrival_s <= now:
            active.append(order[next_arrival])
            next_arrival += 1
        if not active:
            now = max(now + step_s, order[next_arrival].spec.arrival_s)
            continue
        active.sort(
            key=lambda j: (tiresias_queue(j.attained, quanta), j.spec.arrival_s, j.spec.job_id)
        )
        prev = {j.spec.job_id: j.size for j in active}
        sizes = _decide(active, gpus, et, elastic)
        # progress over the step
        for j in active:
            size = sizes[j.spec.job_id]
            before = prev[j.spec.job_id]
            stall = 0.0
            if size and before and size != before:
                stall = rescale_s
                result.rescales += 1
            elif size and not before and j.started:
                stall = restart_s
            if before and not size:
                result.preemptions += 1
            j.size = size
            if not size:
                continue
            j.started = True
            rate = tput.throughput(size)
            useful = max(0.0, step_s - stall)
            if j.work <= rate * useful:
                used = stall + j.work / rate
                j.end = now + used
                result.busy_gpu_s += size * used
                j.attained += size * used
                j.work = 0.0
            else:
                j.work -= rate * useful
                j.attained += size * step_s
                result.busy_gpu_s += size * step_s
        for j in active:
            if j.end is not None:
                result.jct_s[j.spec.job_id] = j.end - j.spec.arrival_s
                result.makespan_s = max(result.makespan_s, j.end)
                result.completed += 1
        active = [j for j in active if j.end is None]
        now += step_s
    return result


def _decide(active: list[_Job], gpus: int, et: ElasticTiresias, elastic: bool) -> dict[str, int]:
    """Each active job's size for the next step (``active`` is in Tiresias order)."""
    free = gpus
    sizes: dict[str, int] = {}
    for j in active:
        want = min(j.spec.gpus, gpus)
        if elastic and j.size:
            want = min(j.size, want)  # grown learners are given back first
        if want <= free:
            sizes[j.spec.job_id] = want
        elif elastic and j.size and free >= j.spec.min_gpus:
            sizes[j.spec.job_id] = free  # a running elastic job narrows rather than stops
        else:
            sizes[j.spec.job_id] = 0
        free -= sizes[j.spec.job_id]
    if not elastic:
        return sizes
    waiting = [j for j in active if not sizes[j.spec.job_id]]
    for j in waiting:
        need = min(j.spec.gpus, gpus)
        running = _elastic_view([r for r in active if sizes[r.spec.job_id]], sizes)
        pending = sum(1 for w in active if not sizes[w.spec.job_id])
        decisions = et.shrink(need, pending, running, _fits(free, need, running))
        if not decisions:
            continue
        for d in decisions:
            free += sizes[d.job_id] - d.learners
            sizes[d.job_id] = d.learners
        sizes[j.spec.job_id] = need
        free -= need
    if free > 0 and all(sizes[j.spec.job_id] for j in active):
        budget = [free]

        def take(job_id: str) -> bool:
            if budget[0] <= 0:
                return False
            budget[0] -= 1
            return True

        for d in et.grow(_elastic_view(active, sizes), take):
            sizes[d.job_id] = d.learners
    return sizes


def _elastic_view(jobs: list[_Job], sizes: dict[str, int]) -> list[ElasticJob]:
    return [
        ElasticJob(
            r.spec.job_id,
            sizes[r.spec.job_id],
            r.spec.min_gpus,
            r.max_gpus,
            1,
            r.attained,
            r.spec.arrival_s,
            "gpu",
        )
        for r in jobs
    ]


def _fits(free: int, need: int, running: list[ElasticJob]) -> FitsWith:
    """Would ``need`` GPUs be free if the running jobs had the proposed sizes?"""
    current = {r.job_id: r.learners for r in running}

    def fits(new: Mapping[str, int]) -> bool:
        return free + sum(current[k] - v for k, v in new.items()) >= need

    return fits


def throughput_model(
    name: str = MEASURED, overhead: float = 0.05, curve: str | Path | None = None
) -> tuple[ThroughputModel, str]:
    """The simulator's throughput model by name, and a line that describes it: ``measured``
    (``curve``, default the bundled one) or ``comm-bound`` (``overhead``)."""
    if name == COMM_BOUND:
        return CommunicationBound(overhead), f"comm-bound, overhead {overhead}"
    if name == MEASURED:
        path = Path(curve) if curve is not None else BUNDLED_THROUGHPUT_CURVE
        model: MeasuredThroughput = load_throughput_curve(path)
        label = "bundled" if curve is None else str(path)
        pts = " ".join(f"{p}:{t:.2f}" for p, t in model.points)
        return model, (
            f"measured ({label}: {pts}; beyond p={model.points[-1][0]} fitted overhead "
            f"{model.overhead:.3f})"
        )
    raise ValueError(
        f"unknown throughput model {name!r}; choose one of {', '.join(THROUGHPUT_MODELS)}"
    )


def compare(
    seeds: int = 3,
    jobs: int = 480,
    gpus: int = 64,
    load: float = 1.0,
    overhead: float = 0.05,
    pending_threshold: int = 0,
    throughput: str = MEASURED,
    curve: str | Path | None = None,
) -> dict[str, Any]:
    """Tiresias and Elastic-Tiresias on the same Philly-shaped traces (one per seed) and
    cluster: per run and mean over seeds, JCT mean and p99, utilisation, makespan, and the
    mean JCT per requested size (Amoeba's Table 2 shape). ``throughput`` names the model
    (``throughput_model``); ``overhead`` is used by ``comm-bound`` only."""
    model, described = throughput_model(throughput, overhead, curve)
    runs: list[dict[str, Any]] = []
    by_size: dict[str, dict[str, list[float]]] = {p: {} for p in POLICIES}
    for seed in range(seeds):
        trace = philly_like_trace(seed, jobs, gpus, load)
        for policy in POLICIES:
            res = simulate_elastic(
                trace, gpus, policy, model=model, pending_threshold=pending_threshold
            )
            runs.append(
                {
                    "seed": seed,
                    "policy": policy,
                    "jct_mean_min": round(res.jct_mean_s() / 60, 1),
                    "jct_p99_min": round(res.jct_p99_s() / 60, 1),
                    "utilization_pct": round(100 * res.utilization, 1),
                    "makespan_h": round(res.makespan_s / 3600, 2),
                    "rescales": res.rescales,
                    "preemptions": res.preemptions,
                    "completed": f"{res.completed}/{res.jobs}",
                }
            )
            for name, lo, hi in SIZE_BUCKETS:
                by_size[policy].setdefault(name, []).append(res.jct_mean_s(lo, hi))
    mean = {
        policy: {
            key: sum(float(r[key]) for r in runs if r["policy"] == policy) / seeds
            for key in ("jct_mean_min", "jct_p99_min", "utilization_pct", "makespan_h")
        }
        for policy in POLICIES
    }
    t, e = mean[TIRESIAS], mean[ELASTIC_TIRESIAS]
    per_size = {}
    for name, _, _ in SIZE_BUCKETS:
        ts, es = (
            _nanmean(by_size[TIRESIAS][name]) / 60,
            _nanmean(by_size[ELASTIC_TIRESIAS][name]) / 60,
        )
        per_size[name] = {
            TIRESIAS: round(ts, 1),
            ELASTIC_TIRESIAS: round(es, 1),
            "reduction_pct": round(100 * (1 - es / ts), 1) if ts else math.nan,
        }
    return {
        "settings": {"seeds": seeds, "jobs": jobs, "gpus": gpus, "load": load,
                     "throughput": throughput, "throughput_model": described,
                     "overhead": overhead if throughput == COMM_BOUND else None,
                     "pending_threshold": pending_threshold},
        "runs": runs,
        "mean": mean,
        "jct_mean_reduction_pct": round(100 * (1 - e["jct_mean_min"] / t["jct_mean_min"]), 1),
        "jct_p99_reduction_pct": round(100 * (1 - e["jct_p99_min"] / t["jct_p99_min"]), 1),
        "per_size_jct_mean_min": per_size,
    }  # fmt: skip


def format_compare(out: dict[str, Any]) -> list[str]:
    """``compare``'s result as the lines the benchmark and ``rhizome-sim elastic`` print."""
    st = out["settings"]
    lines = [
        f"# Tiresias vs Elastic-Tiresias: {st['jobs']} jobs (Philly-shaped), {st['gpus']} GPUs, "
        f"load {st['load']}, {st['seeds']} seed(s); throughput model {st['throughput_model']}"
    ]
    head = ("seed", "policy", "jct_mean_min", "jct_p99_min", "utilization_pct", "makespan_h",
            "rescales", "preemptions", "completed")  # fmt: skip
    lines.append(" | ".join(head))
    lines += [" | ".join(str(r[h]) for h in head) for r in out["runs"]]
    lines.append("mean over seeds:")
    for policy in POLICIES:
        m = out["mean"][policy]
        lines.append(
            f"  {policy:17s} JCT mean {m['jct_mean_min']:.1f} min, p99 {m['jct_p99_min']:.1f} "
            f"min, utilisation {m['utilization_pct']:.1f} %, makespan {m['makespan_h']:.2f} h"
        )
    lines.append(
        f"Elastic-Tiresias vs Tiresias: mean JCT {out['jct_mean_reduction_pct']:.1f} % lower, "
        f"p99 JCT {out['jct_p99_reduction_pct']:.1f} % lower (Amoeba: 29.8 % lower mean)"
    )
    lines.append("mean JCT by requested size (min): size | tiresias | elastic-tiresias | reduction")
    for name, v in out["per_size_jct_mean_min"].items():
        lines.append(
            f"  {name:9s} | {v[TIRESIAS]:.1f} | {v[ELASTIC_TIRESIAS]:.1f} | "
            f"{v['reduction_pct']:.1f} %"
        )
    return lines


def _nanmean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan
