"""What the injector preempts: fixed pids, or a running job's current learners.

A job's learners are found through the platform's contract, not another service's state:
the ranks and their statuses from the learner status keys (`contract.etcd_keys`), and the
learner command's processes of a rank by their labels (`contract.procs.labelled`), so a
learner the guardian restarted under a new pid is a target again as soon as it runs.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from contract import etcd_keys, procs
from contract.env import Role
from contract.etcd import EtcdClient
from contract.status import LearnerStatus


class InjectorError(ValueError):
    """Bad injector input (no targets, a bad rate, an unreadable trace)."""


class UnknownJobError(InjectorError):
    """The job has no keys in etcd: a wrong id, or a job that already ended."""


class JobNotRunningError(InjectorError):
    """The job exists but none of its learners can be preempted (all ended, or halted)."""


@dataclass(frozen=True)
class Target:
    """One preemptible unit: a learner rank's processes, or one given pid."""

    key: str  # what `doomed` bookkeeping uses: "pid 123" or "rank 0"
    pids: list[int] = field(default_factory=list)
    rank: int | None = None


class Targets(abc.ABC):
    # Whether a preempted target comes back (a job's rank does; a pid never does).
    refills: bool = False

    @abc.abstractmethod
    def current(self) -> list[Target]:
        """The targets alive now (each with at least one live pid)."""

    def ended(self) -> bool:
        """True once no target will ever appear again (the replay stops)."""
        return False


class PidTargets(Targets):
    def __init__(self, pids: list[int]) -> None:
        if not pids:
            raise InjectorError("no target pids: pass --pid for each learner process")
        self.pids = list(pids)

    def current(self) -> list[Target]:
        return [Target(f"pid {p}", [p]) for p in self.pids if procs.pid_alive(p)]

    def ended(self) -> bool:
        return not self.current()


class JobTargets(Targets):
    """The learners of `job_id` that run their command (status PROCESSING) right now."""

    refills = True

    def __init__(self, etcd: EtcdClient, job_id: str) -> None:
        self.etcd = etcd
        self.job_id = job_id

    def statuses(self) -> dict[int, LearnerStatus]:
        prefix = etcd_keys.learner_prefix(self.job_id)
        out: dict[int, LearnerStatus] = {}
        for key, entry in self.etcd.get_prefix(prefix).items():
            rank, _, leaf = key[len(prefix) :].partition("/")
            if leaf != "status" or not rank.isdigit() or not isinstance(entry.value, dict):
                continue
            out[int(rank)] = LearnerStatus.parse(entry.value.get("status"), LearnerStatus.STARTING)
        return out

    def check(self) -> None:
        """Raise a typed error naming the problem when the job cannot be targeted."""
        if not self.etcd.get_prefix(etcd_keys.job_prefix(self.job_id)):
            raise UnknownJobError(
                f"job {self.job_id!r} is not running on this platform (no keys in etcd): "
                "check the id with `rhizome list`; an ended job's keys are erased"
            )
        if self.ended():
            seen = ", ".join(f"{r}={s}" for r, s in sorted(self.statuses().items()))
            raise JobNotRunningError(
                f"job {self.job_id!r} is not running (learners: {seen or 'none'}); "
                "start it or pick a job whose status is PROCESSING"
            )

    def current(self) -> list[Target]:
        out = []
        for rank, status in sorted(self.statuses().items()):
            if status != LearnerStatus.PROCESSING:
                continue
            pids = procs.labelled(self.job_id, rank, Role.LEARNER)
            if pids:
                out.append(Target(f"rank {rank}", sorted(pids), rank))
        return out

    def ended(self) -> bool:
        """No guardian holds the job and no learner is on its way: nothing restarts it."""
        if self.etcd.get(etcd_keys.guardian_lease(self.job_id)) is not None:
            statuses = self.statuses()
            return bool(statuses) and all(
                s in (LearnerStatus.COMPLETED, LearnerStatus.HALTED) for s in statuses.values()
            )
        return not any(not s.final for s in self.statuses().values())

    def learners(self) -> int:
        return max(len(self.statuses()), 1)
