"""Learner statuses and process exit codes, as both sides read them.

A learner controller writes its `LearnerStatus` to `etcd_keys.learner_status`; the
guardian reads it to move the job. Exit codes are what one process of the chain
(LCM -> guardian -> controller -> user command / runtime launcher -> runtime worker) reads
from the next; values that mean the same to every reader share one member.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import Any


class LearnerStatus(StrEnum):
    """What a learner controller is doing (learner/controller/controller.py)."""

    STARTING = "STARTING"  # claimed its rank (create-if-absent: one controller a rank)
    DOWNLOADING = "DOWNLOADING"  # code and data stores into the job directory
    PROCESSING = "PROCESSING"  # the user command runs
    STORING = "STORING"  # results are copied to the result store
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"  # with the command's exit code
    HALTED = "HALTED"  # a halt was requested

    @property
    def final(self) -> bool:
        """Written without a lease: it outlives the controller for the guardian to read."""
        return self in FINAL_STATUSES

    @classmethod
    def parse(cls, raw: object, default: LearnerStatus | None = None) -> LearnerStatus:
        """The status of a value read from etcd (`default` when it is not one)."""
        try:
            if not isinstance(raw, str):
                raise ValueError(f"{raw!r} is not a learner status")
            return cls(raw)
        except ValueError:
            if default is None:
                raise
            return default


FINAL_STATUSES = frozenset({LearnerStatus.COMPLETED, LearnerStatus.FAILED, LearnerStatus.HALTED})

# Along the happy path, in order (the job's status follows its slowest learner).
HAPPY_PATH = (
    LearnerStatus.STARTING,
    LearnerStatus.DOWNLOADING,
    LearnerStatus.PROCESSING,
    LearnerStatus.STORING,
    LearnerStatus.COMPLETED,
)


def status_value(
    status: LearnerStatus,
    *,
    pid: int,
    start: int | None,
    lease: int,
    generation: int,
    restart: int,
    exit_code: int | None,
    message: str,
    time: float,
    history: list[list[Any]],
) -> dict[str, Any]:
    """The value a learner's status key holds (what the guardian reads): its status, the
    writer's process (`pid`, `start` ticks) for liveness checks, its lease, the deploy
    generation and restart it belongs to, and the last 20 status changes."""
    return {
        "status": status.value,
        "pid": pid,
        "start": start,
        "lease": lease,
        "generation": generation,
        "restart": restart,
        "exit_code": exit_code,
        "message": message,
        "time": time,
        "history": history[-20:],
    }


class ExitCode(IntEnum):
    """Exit codes of every Rhizome process. One value, one meaning for whoever reads it."""

    OK = 0
    FAILED = 1  # anything else went wrong
    USAGE = 2  # bad command line or unreadable spec (argparse's own code)
    # Do not restart me: another guardian holds the job / another controller holds the
    # rank / the pipeline runtime lost a stage and its shadow. The LCM restarts a guardian
    # that exits with anything but OK or FATAL.
    FATAL = 3
    # This process lost its membership: a guardian its etcd lease, a runtime worker its
    # place (its peers declared it dead).
    EVICTED = 4
    # A learner got a missing or malformed environment variable (sysexits' EX_CONFIG);
    # it printed one line naming the variable.
    CONFIG_ERROR = 78
    # A port this server was told to listen on is held by another process (Linux's errno
    # EADDRINUSE). Whoever picked the port may pick another and start it again
    # (services/embedded/process.py); a port the user chose is theirs to change.
    PORT_IN_USE = 98
    KILLED = 137  # 128 + SIGKILL: the command vanished without writing its exit code
    # 128 + SIGTERM: terminated on request, e.g. a learner that saved and left on a
    # preemption notice, so it is never mistaken for one that finished training.
    PREEMPTED = 143


# How a learner ends when its node is preempted: exited after SIGTERM (the checkpoint
# SDK's emergency save exits so), SIGKILL (137, or -9 from a direct parent), or died of
# SIGTERM (-15).
PREEMPTION_EXIT_CODES = frozenset({int(ExitCode.PREEMPTED), int(ExitCode.KILLED), -9, -15})
