"""The etcd keys a learner controller reads and writes.

A mirror of the learner part of `services/store/etcd_keys.py`, because `learner/` never
imports `services/`; tests/learner/controller/test_keys.py checks that the two agree.
"""

from __future__ import annotations

ROOT = "/rhizome"


def job_prefix(job_id: str) -> str:
    return f"{ROOT}/jobs/{job_id}/"


def learner_status(job_id: str, rank: int) -> str:
    return f"{job_prefix(job_id)}learners/{rank}/status"


def learner_prefix(job_id: str) -> str:
    return f"{job_prefix(job_id)}learners/"


def control(job_id: str) -> str:
    """Halt / resume / scale requests for a job's learners."""
    return f"{job_prefix(job_id)}control"
