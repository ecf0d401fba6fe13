"""Job traces: the two FfDL experiments' workloads, and trace files.

A trace file is JSON (a list of objects) or CSV with the columns
``job_id, arrival_s, duration_s, learners, gpus, gpu_type`` (``owner``, and ``cpus`` and
``memory_mb`` per learner, optional).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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
    # Per learner, as a manifest's cpus and memory; 0 leaves them out of placement.
    cpus: float = 0.0
    memory_mb: float = 0.0


def ffdl_gang_cluster(nodes: int = 15, gpus_per_node: int = 4) -> list[Node]:
    """FfDL §5.3: 15 nodes × 4 GPUs (K80)."""
    return [
        Node(f"k80-{i}", cpus=32, memory_mb=256_000, gpus=gpus_per_node, gpu_type="K80")
        for i in range(nodes)
    ]


# FfDL §5.3's job shapes: (learners, GPUs per learner).
FFDL_GANG_SHAPES: tuple[tuple[int, int], ...] = ((2, 1), (2, 2), (4, 1))


def ffdl_gang_trace(
    seed: int,
    jobs_per_shape: int = 50,
    shapes: Sequence[tuple[int, int]] = FFDL_GANG_SHAPES,
) -> list[TraceJob]:
    """FfDL §5.3: 50 jobs each of 2×1, 2×2 and 4×1 (learners × GPUs), submitted together.

    Durations are uniform in 10-60 minutes (the paper does not give them); the order in
    which the jobs reach the scheduler is shuffled by ``seed``.
    """
    rng = np.random.default_rng(seed)
    shapes = list(shapes) * jobs_per_shape
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


class TraceError(ValueError):
    """A job trace file that cannot be read; the message names the file, row and fix."""


_COLUMNS = (
    "job_id, arrival_s, duration_s, learners, gpus, gpu_type (owner, cpus, memory_mb optional)"
)


def load_trace(path: str | Path) -> list[TraceJob]:
    """Read a JSON (list of objects) or CSV (header row) job trace, checking every row."""
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise TraceError(f"cannot read trace {p}: {err}") from None
    if not text.strip():
        raise TraceError(f"{p}: the trace is empty; write one job per row: {_COLUMNS}")
    rows: list[tuple[str, Any]]
    if p.suffix == ".json":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as err:
            raise TraceError(f"{p}:{err.lineno}: not valid JSON: {err.msg}") from None
        if not isinstance(doc, list):
            raise TraceError(f"{p}: a JSON trace is a list of jobs, each an object: {_COLUMNS}")
        rows = [(f"job {n}", row) for n, row in enumerate(doc)]
    else:
        reader = csv.DictReader(text.splitlines())
        # line numbers count the header as line 1
        rows = [(f"{n + 2}", row) for n, row in enumerate(reader)]
    jobs: list[TraceJob] = []
    seen: set[str] = set()
    for where, row in rows:
        if not isinstance(row, dict):
            raise TraceError(f"{p}:{where}: expected an object with {_COLUMNS}, got {row!r}")
        try:
            job = TraceJob(
                job_id=str(row.get("job_id") or f"job-{len(jobs):05d}"),
                arrival_s=float(row["arrival_s"]),
                duration_s=float(row["duration_s"]),
                learners=int(row["learners"]),
                gpus=int(row["gpus"]),
                gpu_type=str(row.get("gpu_type") or ""),
                owner=str(row.get("owner") or ""),
                cpus=float(row.get("cpus") or 0.0),
                memory_mb=float(row.get("memory_mb") or 0.0),
            )
        except KeyError as exc:
            raise TraceError(f"{p}:{where}: no {exc.args[0]} column; expected {_COLUMNS}") from None
        except (TypeError, ValueError) as exc:
            raise TraceError(f"{p}:{where}: {exc}; expected {_COLUMNS}") from None
        if (
            job.arrival_s < 0
            or job.duration_s <= 0
            or job.learners < 1
            or min(job.gpus, job.cpus, job.memory_mb) < 0
        ):
            raise TraceError(
                f"{p}:{where}: job {job.job_id}: need arrival_s >= 0, duration_s > 0, "
                f"learners >= 1, and gpus, cpus, memory_mb >= 0"
            )
        if job.job_id in seen:
            raise TraceError(f"{p}:{where}: job_id {job.job_id} appears twice; ids must be unique")
        seen.add(job.job_id)
        jobs.append(job)
    if not jobs:
        raise TraceError(f"{p}: the trace has no jobs; write one job per row: {_COLUMNS}")
    return jobs


def save_trace(jobs: list[TraceJob], path: str | Path) -> None:
    Path(path).write_text(json.dumps([asdict(j) for j in jobs], indent=1))
