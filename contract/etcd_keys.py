"""The etcd key layout (ARCHITECTURE §3): every key the platform or a learner writes is
built here, so the two sides cannot drift apart.

Values stay under 1 KB; everything under `job_prefix(job_id)` is erased when the job ends.
Owners: the guardian writes `guardian`, `deploy/*` and `runtime/config`; the LCM writes
`control` and `leaders/*`; each learner controller writes `learners/<rank>/status`; the
pipeline runtime's workers write everything else under `runtime/`.
"""

from __future__ import annotations

ROOT = "/rhizome"


def jobs_prefix() -> str:
    """Every job's keys (the LCM scans it for guardian leases)."""
    return f"{ROOT}/jobs/"


def job_prefix(job_id: str) -> str:
    return f"{jobs_prefix()}{job_id}/"


def guardian_lease(job_id: str) -> str:
    """Held by the live guardian of a job (its lease marks liveness)."""
    return f"{job_prefix(job_id)}guardian"


def deploy_step(job_id: str, step: str) -> str:
    return f"{job_prefix(job_id)}deploy/{step}"


def deploy_prefix(job_id: str) -> str:
    return f"{job_prefix(job_id)}deploy/"


def learner_status(job_id: str, rank: int) -> str:
    """A learner controller's status (`contract.status.LearnerStatus` and details)."""
    return f"{job_prefix(job_id)}learners/{rank}/status"


def learner_prefix(job_id: str) -> str:
    return f"{job_prefix(job_id)}learners/"


def control(job_id: str) -> str:
    """Halt / resume / scale requests for a job's learners."""
    return f"{job_prefix(job_id)}control"


def runtime_prefix(job_id: str) -> str:
    """The pipeline runtime's keys: `state`, `members/<w>`, `failures/*`, `rendezvous/*`,
    `partition` (learner/runtime/cluster_state.py), the rendezvous store's `store/*`
    (learner/runtime/etcd_store.py) and the guardian's `config`."""
    return f"{job_prefix(job_id)}runtime/"


def runtime_config(job_id: str) -> str:
    """World size and rendezvous address the guardian publishes for the runtime."""
    return f"{runtime_prefix(job_id)}config"


def runtime_store_prefix(job_id: str) -> str:
    """The pipeline runtime's rendezvous store on the platform (learner/runtime/etcd_store.py:
    a `torch.distributed.Store` whose keys are gloo's addresses, base64 in JSON)."""
    return f"{runtime_prefix(job_id)}store/"


def leader(role: str) -> str:
    """Leader-election key for a service role (e.g. the LCM)."""
    return f"{ROOT}/leaders/{role}"


def job_of(key: str) -> str | None:
    """The job id of a key under `jobs_prefix()` (None for any other key)."""
    if not key.startswith(jobs_prefix()):
        return None
    job_id = key[len(jobs_prefix()) :].split("/", 1)[0]
    return job_id or None


def runtime_ticket(job_id: str, worker: int) -> str:
    """A replacement's admission ticket (`{"token", "generation"}`), written by the
    guardian when it starts a replacement for a lost pipeline learner; the runtime admits
    the joiner presenting that token (learner/runtime/reconfigure.py)."""
    return f"{runtime_prefix(job_id)}tickets/{worker}"
