"""Job states and the transitions between them (ARCHITECTURE §4).

Every status a job can have, and who moves it there:

- ``QUEUED``      the API stored the job; it waits for the gang scheduler.
- ``PENDING``     the scheduler placed the whole gang; the LCM starts its guardian.
- ``DEPLOYING``   the guardian deploys the job step by step (keys, volume, learners).
- ``DOWNLOADING`` learners fetch code and data into the job directory.
- ``PROCESSING``  the user command runs.
- ``STORING``     results are written to the job's result store.
- ``COMPLETED``   terminal: every learner finished and the results are stored.
- ``FAILED``      terminal: deploy retries exhausted or a learner failed for good.
- ``HALTED``      the user (or a quota owner) stopped the job; resuming queues it again.
- ``RESUMING``    nothing sets it any more: a resumed job goes HALTED -> QUEUED and is
                  placed by the scheduler like a new job (it then redeploys from its
                  checkpoint directory). Kept so that records written before can be read.
- ``RECOVERING``  the runtime fails over after a preemption (no restart).
- ``RESCALING``   the runtime changes size (elastic scale in/out).
- ``DELETED``     terminal: the user deleted the job; nothing of it runs.

A transition not in ``LEGAL_TRANSITIONS`` is refused by the repository, never written.
Re-entering the same status is not a transition and is refused too, so a retried
write is idempotent through the fencing token instead.
"""

from __future__ import annotations

import itertools

from rhizome.v1.job_pb2 import JobStatus

QUEUED = "QUEUED"
PENDING = "PENDING"
DEPLOYING = "DEPLOYING"
DOWNLOADING = "DOWNLOADING"
PROCESSING = "PROCESSING"
STORING = "STORING"
COMPLETED = "COMPLETED"
FAILED = "FAILED"
HALTED = "HALTED"
RESUMING = "RESUMING"
RECOVERING = "RECOVERING"
RESCALING = "RESCALING"
DELETED = "DELETED"

ALL_STATES: tuple[str, ...] = (
    QUEUED,
    PENDING,
    DEPLOYING,
    DOWNLOADING,
    PROCESSING,
    STORING,
    COMPLETED,
    FAILED,
    HALTED,
    RESUMING,
    RECOVERING,
    RESCALING,
    DELETED,
)

TERMINAL_STATES: frozenset[str] = frozenset({COMPLETED, FAILED, DELETED})
# States in which a job holds resources (learners may be running).
ACTIVE_STATES: frozenset[str] = frozenset(
    {PENDING, DEPLOYING, DOWNLOADING, PROCESSING, STORING, RESUMING, RECOVERING, RESCALING}
)

_RUNNING = {DOWNLOADING, PROCESSING, STORING, RECOVERING, RESCALING}

LEGAL_TRANSITIONS: dict[str, frozenset[str]] = {
    QUEUED: frozenset({PENDING, HALTED, FAILED, DELETED}),
    # PENDING -> QUEUED: a placement released (e.g. a borrowing job preempted before deploy).
    PENDING: frozenset({QUEUED, DEPLOYING, HALTED, FAILED, DELETED}),
    # DEPLOYING -> DEPLOYING is not allowed; a rollback-and-retry stays in DEPLOYING.
    DEPLOYING: frozenset({DOWNLOADING, PROCESSING, HALTED, FAILED, DELETED, QUEUED}),
    DOWNLOADING: frozenset({PROCESSING, HALTED, FAILED, DELETED, RECOVERING}),
    PROCESSING: frozenset({STORING, COMPLETED, HALTED, FAILED, DELETED, RECOVERING, RESCALING}),
    STORING: frozenset({COMPLETED, FAILED, DELETED, HALTED}),
    RECOVERING: frozenset({PROCESSING, FAILED, HALTED, DELETED, RESCALING}),
    RESCALING: frozenset({PROCESSING, FAILED, HALTED, DELETED, RECOVERING}),
    HALTED: frozenset({RESUMING, DELETED, QUEUED}),
    RESUMING: frozenset({DEPLOYING, DOWNLOADING, PROCESSING, HALTED, FAILED, DELETED}),
    COMPLETED: frozenset({DELETED}),
    FAILED: frozenset({DELETED}),
    DELETED: frozenset(),
}

assert set(LEGAL_TRANSITIONS) == set(ALL_STATES)
assert set(ALL_STATES) >= _RUNNING


class IllegalTransition(ValueError):
    """A status change that the state machine does not allow."""

    def __init__(self, job_id: str, current: str, target: str) -> None:
        allowed = ", ".join(sorted(LEGAL_TRANSITIONS.get(current, frozenset()))) or "none"
        super().__init__(
            f"job {job_id}: cannot go from {current} to {target} (allowed from {current}: {allowed})"
        )
        self.job_id = job_id
        self.current = current
        self.target = target


def is_legal(current: str, target: str) -> bool:
    return target in LEGAL_TRANSITIONS.get(current, frozenset())


def is_terminal(status: str) -> bool:
    return status in TERMINAL_STATES


def check_history(statuses: list[str]) -> None:
    """Raise IllegalTransition if a recorded history contains an illegal step."""
    if statuses and statuses[0] != QUEUED:
        raise IllegalTransition("?", "(none)", statuses[0])
    for prev, nxt in itertools.pairwise(statuses):
        if not is_legal(prev, nxt):
            raise IllegalTransition("?", prev, nxt)


def to_proto(status: str) -> int:
    return int(JobStatus.Value(status))


def from_proto(value: int) -> str:
    name = JobStatus.Name(value)  # type: ignore[arg-type]
    if name == "JOB_STATUS_UNSPECIFIED":
        raise ValueError("job status is unspecified")
    return str(name)
