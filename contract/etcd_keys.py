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


# -- elastic data-parallel jobs (learner/elastic/, docs/elastic.md) ------------------------------
def elastic_prefix(job_id: str) -> str:
    """An elastic job's coordination keys: `state`, `leader`, `abort`, `plan`, `expect`,
    `workers/<w>`, `joins/<w>`, `acks/<w>`, `refused/<w>`, `leaves/<w>`."""
    return f"{job_prefix(job_id)}elastic/"


def elastic_state(job_id: str) -> str:
    """The membership: generation, members in rank order, the generation's store address.
    Only the leader writes it, each write a compare-and-set on its mod_revision."""
    return f"{elastic_prefix(job_id)}state"


def elastic_leader(job_id: str) -> str:
    """Held (created, bound to its lease) by the job's leader; gone when it leaves or dies."""
    return f"{elastic_prefix(job_id)}leader"


def elastic_abort(job_id: str) -> str:
    """The generation a worker saw fail (a peer lost mid-collective): everyone re-forms."""
    return f"{elastic_prefix(job_id)}abort"


def elastic_plan(job_id: str) -> str:
    """The leader's copy of the data assignment (epoch, cursors, returned ranges) and step."""
    return f"{elastic_prefix(job_id)}plan"


def elastic_expect(job_id: str) -> str:
    """`{count, deadline}`, written by the guardian while it adds `count` learners: the
    leader admits pending joiners once `count` of them wait (one re-form for all), or at
    `deadline` (wall-clock seconds) with those that came."""
    return f"{elastic_prefix(job_id)}expect"


def elastic_worker(job_id: str, worker: str) -> str:
    """A worker's liveness, bound to its lease."""
    return f"{elastic_prefix(job_id)}workers/{worker}"


def elastic_workers_prefix(job_id: str) -> str:
    return f"{elastic_prefix(job_id)}workers/"


def elastic_join(job_id: str, worker: str) -> str:
    """A ready joiner's request, naming the generation it read."""
    return f"{elastic_prefix(job_id)}joins/{worker}"


def elastic_joins_prefix(job_id: str) -> str:
    return f"{elastic_prefix(job_id)}joins/"


def elastic_ack(job_id: str, worker: str) -> str:
    """A member's "I am at the boundary of generation g and alive" during a re-form."""
    return f"{elastic_prefix(job_id)}acks/{worker}"


def elastic_refusal(job_id: str, worker: str) -> str:
    """Why the leader refused a join (a stale generation)."""
    return f"{elastic_prefix(job_id)}refused/{worker}"


def elastic_leave(job_id: str, worker: str) -> str:
    """Why a member left (graceful, straggler), for the scheduler and the logs."""
    return f"{elastic_prefix(job_id)}leaves/{worker}"


def elastic_acks_prefix(job_id: str) -> str:
    return f"{elastic_prefix(job_id)}acks/"
