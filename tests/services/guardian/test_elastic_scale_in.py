"""A scale-in by more than one learner stops the retired ranks at once (real etcd and
MongoDB-wire server; the backend is a stand-in that records how its stops overlapped):
their workers then leave at the same mini-batch boundary, one re-form of the
survivors instead of one per rank (benchmarks/elastic_scaling.py --platform measured
4 -> 2 at 2 re-forms, 2.95 iterations, against 1 re-form, 1.16 iterations, bare)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from contract import etcd_keys
from services.backends.api import JobSpec
from services.guardian.elastic import ElasticScaler, ScaleFailed, request_scale
from services.store import states
from tests.services.guardian.helpers import submit

pytestmark = pytest.mark.integration


class OverlapBackend:
    """`stop_learner` waits (up to 30 s) until as many stops as `expected` are in
    flight together: stopped one after the other, each waits alone and says so."""

    def __init__(self, expected: int) -> None:
        self.barrier = threading.Barrier(expected, timeout=30)
        self.together: list[int] = []
        self.alone: list[int] = []
        self.lock = threading.Lock()

    def stop_learner(self, job_id: str, rank: int, grace_s: float) -> None:
        try:
            self.barrier.wait()
            together = True
        except threading.BrokenBarrierError:
            together = False
        with self.lock:
            (self.together if together else self.alone).append(rank)


def test_a_scale_in_by_two_stops_both_retired_ranks_together(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    repo, etcd = stores["repo"], stores["etcd"]
    job = submit(repo, tmp_path, "true", learners=3, elastic={"min": 1, "max": 3})
    for status in (states.DEPLOYING, states.PROCESSING):
        repo.transition(job.job_id, status, status.lower())
    etcd.put(etcd_keys.deploy_step(job.job_id, "complete"), {"generation": 1})
    request_scale(etcd, repo, job.job_id, 1, "scaled in by the test")

    backend = OverlapBackend(expected=2)
    guardian = SimpleNamespace(
        etcd=etcd, jobs=repo, job_id=job.job_id, backend=backend, handles={1: "h1", 2: "h2"}
    )
    spec = JobSpec(
        job_id=job.job_id,
        command="true",
        learners=3,
        job_dir=str(tmp_path / "jobs" / job.job_id),
        checkpoint_dir=str(tmp_path / "ckpt"),
        result_store="",
        etcd_url=stores["etcd_url"],
        manifest=None,  # type: ignore[arg-type]  # a scale-in does not read it
        placement={"learner_nodes": {"0": "n0", "1": "n1", "2": "n2"}},
    )
    scaler = ElasticScaler(guardian)  # type: ignore[arg-type]
    record, smaller = scaler.apply(repo.get(job.job_id), spec)

    assert (sorted(backend.together), backend.alone) == ([1, 2], [])
    assert record.status == states.PROCESSING and record.resources["learners"] == 1
    assert smaller.learners == 1 and smaller.placement["learner_nodes"] == {"0": "n0"}
    assert guardian.handles == {}
    assert record.history[-1].message == (
        "scaled 3 → 1 learners: learners 1, 2 left at a mini-batch boundary"
    )


class DeadAtStartBackend:
    """The added learner's controller died before it wrote any status."""

    def learner_exited(self, handle: str) -> int | None:
        return 1 if handle == "h2" else None


def test_a_scale_out_whose_learner_dies_at_start_fails_at_once_not_at_the_timeout(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    guardian = SimpleNamespace(
        etcd=stores["etcd"],
        jobs=stores["repo"],
        job_id="dead-at-start",
        backend=DeadAtStartBackend(),
        handles={2: "h2"},
        job_dir=str(tmp_path),
        terminate=threading.Event(),
        wake=threading.Event(),
        control=dict,
    )
    scaler = ElasticScaler(guardian)  # type: ignore[arg-type]
    with pytest.raises(ScaleFailed, match="learner 2's controller exited with code 1 before"):
        scaler._wait_processing([2], deadline=time.monotonic() + 300)
