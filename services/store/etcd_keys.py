"""The etcd key layout (ARCHITECTURE §3). Every key the platform writes is built here.

Values stay under 1 KB; everything under `job_prefix(job_id)` is erased when the job ends.
The learner side (learner/controller) keeps a mirror of the learner keys it needs, because
learner/ never imports services/; tests/services/store/test_etcd_keys.py checks they agree.
"""

from __future__ import annotations

ROOT = "/rhizome"


def job_prefix(job_id: str) -> str:
    return f"{ROOT}/jobs/{job_id}/"


def guardian_lease(job_id: str) -> str:
    """Held by the live guardian of a job (its lease marks liveness)."""
    return f"{job_prefix(job_id)}guardian"


def deploy_step(job_id: str, step: str) -> str:
    return f"{job_prefix(job_id)}deploy/{step}"


def deploy_prefix(job_id: str) -> str:
    return f"{job_prefix(job_id)}deploy/"


def learner_status(job_id: str, rank: int) -> str:
    return f"{job_prefix(job_id)}learners/{rank}/status"


def learner_prefix(job_id: str) -> str:
    return f"{job_prefix(job_id)}learners/"


def control(job_id: str) -> str:
    """Halt / resume / scale requests for a job's learners."""
    return f"{job_prefix(job_id)}control"


def runtime_prefix(job_id: str) -> str:
    return f"{job_prefix(job_id)}runtime/"


def leader(role: str) -> str:
    """Leader-election key for a service role (e.g. the LCM)."""
    return f"{ROOT}/leaders/{role}"
