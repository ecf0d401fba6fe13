"""Run all P x D workers as threads of this process (gloo over a HashStore, in-memory state).

The same ``Worker`` code as a multi-process run, minus process boundaries: useful for the
cheap equality checks over many configurations. It cannot simulate a preemption (a
SIGKILL takes the whole process); the failure tests use the launcher.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from learner.runtime.api import PipelineJob
from learner.runtime.cluster_state import InMemoryClusterStateStore
from learner.runtime.engine import Worker, WorkerOptions


def run_in_process(
    job: PipelineJob, stages: int, pipelines: int, **options: Any
) -> list[dict[str, torch.Tensor]]:
    """Train ``job``; returns each worker's owned parameters (full-model keys), by worker."""
    n = stages * pipelines
    opts = [
        WorkerOptions(worker=w, stages=stages, pipelines=pipelines, **options) for w in range(n)
    ]
    return [params for _, params in run_workers(job, opts)]


def run_workers(
    job: PipelineJob, options: list[WorkerOptions]
) -> list[tuple[Worker, dict[str, torch.Tensor]]]:
    """Train ``job`` with one worker per entry of ``options`` (each its own, e.g. its own
    metrics file); returns each ``Worker`` (what tests inspect after a run: its events,
    profiles, losses) with its owned parameters, by worker. The first error is raised."""
    shared = InMemoryClusterStateStore()
    store = dist.HashStore()
    workers = [Worker(job, opts, shared.view(), store) for opts in options]
    results: list[dict[str, torch.Tensor]] = [{} for _ in workers]
    errors: list[BaseException] = []

    def run(w: int) -> None:
        try:
            results[w] = workers[w].run()
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(w,), name=f"worker{w}") for w in range(len(workers))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return list(zip(workers, results, strict=True))


def merge_params(per_worker: list[dict[str, torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    """Key -> every copy of that parameter (one per pipeline that owns it)."""
    out: dict[str, list[torch.Tensor]] = {}
    for params in per_worker:
        for k, v in params.items():
            out.setdefault(k, []).append(v)
    return out
