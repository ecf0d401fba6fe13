"""Job traces: the two FfDL experiments' workloads, and trace files.

A trace file is JSON (a list of objects) or CSV with the columns
``job_id, arrival_s, duration_s, learners, gpus, gpu_type`` (``owner`` optional).
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from services.scheduler.cluster import Node


@dataclass(frozen=True)
class TraceJob:
    job_id: str
    arrival_s: float
    duration_s: float
    learners: int
    gpus: int
    gpu_type: str
    owner: str = ""


def ffdl_gang_cluster(nodes: int = 15, gpus_per_node: int = 4) -> list[Node]:
    """FfDL §5.3: 15 nodes × 4 GPUs (K80)."""
    return [
        Node(f"k80-{i}", cpus=32, memory_mb=256_000, gpus=gpus_per_node, gpu_type="K80")
        for i in range(nodes)
    ]


def ffdl_gang_trace(seed: int, jobs_per_shape: int = 50) -> list[TraceJob]:
    """FfDL §5.3: 50 jobs each of 2×1, 2×2 and 4×1 (learners × GPUs), submitted together.

    Durations are uniform in 10-60 minutes (the paper does not give them); the order in
    which the jobs reach the scheduler is shuffled by ``seed``.
    """
    rng = np.random.default_rng(seed)
    shapes = [(2, 1), (2, 2), (4, 1)] * jobs_per_shape
    order = rng.permutation(len(shapes))
    return [
        TraceJob(
            job_id=f"job-{n:03d}",
            arrival_s=0.0,
            duration_s=float(rng.uniform(600, 3600)),
            learners=shapes[i][0],
            gpus=shapes[i][1],
            gpu_type="K80",
        )
        for n, i in enumerate(order)
    ]


def ffdl_pack_cluster() -> list[Node]:
    """FfDL §5.2 shape: 400 GPUs, 180 K80 + 220 V100, 4 GPUs per node."""
    k80 = [Node(f"k80-{i}", cpus=32, memory_mb=256_000, gpus=4, gpu_type="K80") for i in range(45)]
    v100 = [
        Node(f"v100-{i}", cpus=32, memory_mb=256_000, gpus=4, gpu_type="V100") for i in range(55)
    ]
    return k80 + v100


def ffdl_day_trace(seed: int, hours: float = 24.0, load: float = 0.9) -> list[TraceJob]:
    """A synthetic day on the 400-GPU cluster: Poisson arrivals at the offered ``load``.

    Learners ∈ {1, 2, 4, 8} (p = .4, .3, .2, .1), GPUs per learner ∈ {1, 2, 4}
    (p = .5, .25, .25), log-normal durations (median 40 min, capped at 8 h), GPU type in
    proportion to the cluster (45 % K80). The arrival rate is set so that the mean
    demand in GPU-hours per hour is ``load`` × 400.
    """
    rng = np.random.default_rng(seed)
    mean_gpus = (0.4 * 1 + 0.3 * 2 + 0.2 * 4 + 0.1 * 8) * (0.5 * 1 + 0.25 * 2 + 0.25 * 4)
    median_s, sigma = 2400.0, 1.0
    mean_dur = float(np.mean(np.minimum(rng.lognormal(np.log(median_s), sigma, 100_000), 8 * 3600)))
    rate_per_s = load * 400 / (mean_gpus * mean_dur)
    jobs: list[TraceJob] = []
    t = 0.0
    while True:
        t += float(rng.exponential(1.0 / rate_per_s))
        if t > hours * 3600:
            break
        jobs.append(
            TraceJob(
                job_id=f"job-{len(jobs):05d}",
                arrival_s=t,
                duration_s=float(min(rng.lognormal(np.log(median_s), sigma), 8 * 3600)),
                learners=int(rng.choice([1, 2, 4, 8], p=[0.4, 0.3, 0.2, 0.1])),
                gpus=int(rng.choice([1, 2, 4], p=[0.5, 0.25, 0.25])),
                gpu_type="K80" if rng.random() < 0.45 else "V100",
            )
        )
    return jobs


def load_trace(path: str | Path) -> list[TraceJob]:
    p = Path(path)
    if p.suffix == ".json":
        rows = json.loads(p.read_text())
    else:
        with p.open(newline="") as fh:
            rows = list(csv.DictReader(fh))
    jobs = []
    for n, row in enumerate(rows):
        try:
            jobs.append(
                TraceJob(
                    job_id=str(row.get("job_id") or f"job-{n:05d}"),
                    arrival_s=float(row["arrival_s"]),
                    duration_s=float(row["duration_s"]),
                    learners=int(row["learners"]),
                    gpus=int(row["gpus"]),
                    gpu_type=str(row.get("gpu_type") or ""),
                    owner=str(row.get("owner") or ""),
                )
            )
        except (KeyError, ValueError) as exc:
            raise ValueError(
                f"{p}: row {n}: {exc!r}; expected job_id, arrival_s, duration_s, learners, gpus, gpu_type"
            ) from exc
    return jobs


def save_trace(jobs: list[TraceJob], path: str | Path) -> None:
    Path(path).write_text(json.dumps([asdict(j) for j in jobs], indent=1))
