"""The scheduler's public vocabulary: requests, results, job states, interfaces, errors.

Everything another package needs from the scheduler is named here, so that the
service, the simulator and the tests depend on this module and not on internals.

Job states inside the scheduler (``SchedState``), every one mapped:

- ``QUEUED``   admitted, waiting for a gang placement; holds nothing on the cluster.
  A job halted to return borrowed quota is QUEUED again (``preemptions`` > 0).
- ``RESERVED`` the whole gang is placed and its resources are held, but the learner
  pods are not visible yet (the LCM/guardian is still deploying). A reservation
  counts exactly like a running job for capacity and quota, so nothing is
  double-booked while pods come up.
- ``BOUND``    the learners are visible (``confirm``): the placement is final.
- released jobs are forgotten: ``release`` frees the resources and drops the record.
"""

from __future__ import annotations

import abc
import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from services.scheduler.cluster import Cluster


class SchedulerError(Exception):
    """Base of every error the scheduler raises on purpose; the message says how to fix it."""


class InvalidJobRequest(SchedulerError, ValueError):
    """The request itself is malformed (zero learners, negative CPUs, fractional GPUs...)."""


class UnknownGpuType(InvalidJobRequest):
    """The job asks for a GPU type no node of the cluster has."""


class JobTooLarge(SchedulerError):
    """The gang could never fit, even on the empty cluster or within the user's hard limit."""


class QuotaConfigError(SchedulerError, ValueError):
    """The quota configuration is malformed (unknown key, unknown GPU type, negative number)."""


class ClusterConfigError(SchedulerError, ValueError):
    """The cluster configuration is malformed (unknown key, duplicate node, bad number)."""


class UnknownPolicy(SchedulerError, KeyError):
    """No placement policy is registered under that name."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class UnknownJob(SchedulerError, KeyError):
    """The scheduler has no record of that job id."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class NoRoomForLearner(SchedulerError):
    """A replacement learner (a gang of one) does not fit anywhere now: the caller waits
    and asks again; the message says what is missing."""


class OverCommitError(SchedulerError):
    """An allocation would exceed a node's free resources. Never expected: it is a bug guard."""


class SchedState(enum.StrEnum):
    QUEUED = "queued"
    RESERVED = "reserved"
    BOUND = "bound"


# Jobs whose arrival times are this close (seconds, chained) count as submitted together.
DEFAULT_BATCH_WINDOW_S = 1.0


@dataclass(frozen=True)
class JobRequest:
    """What the scheduler needs to know about a job. Resources are *per learner*.

    ``max_nodes`` bounds how many nodes the gang may span (None: any number).
    ``zone_aware`` asks that consecutive learners (pipeline stages) land in different
    zones where the cluster has them (Bamboo §5.1). ``node_selector`` keeps learners on
    nodes whose labels contain every given pair.
    """

    job_id: str
    learners: int
    gpus: int = 0
    gpu_type: str = ""
    cpus: float = 0.0
    memory_mb: float = 0.0
    owner: str = ""
    priority: int = 0
    arrival: float = 0.0
    max_nodes: int | None = None
    zone_aware: bool = False
    node_selector: Mapping[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise InvalidJobRequest naming the first bad field and how to fix it."""
        if not self.job_id:
            raise InvalidJobRequest("job_id is empty: every job needs an id")
        if not isinstance(self.learners, int) or self.learners < 1:
            raise InvalidJobRequest(
                f"job {self.job_id}: learners={self.learners!r}; a job needs at least 1 learner"
            )
        if not isinstance(self.gpus, int) or self.gpus < 0:
            raise InvalidJobRequest(
                f"job {self.job_id}: gpus={self.gpus!r} per learner; use a whole number >= 0"
            )
        for name in ("cpus", "memory_mb"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise InvalidJobRequest(
                    f"job {self.job_id}: {name}={value!r} per learner; use a number >= 0"
                )
        if self.gpus > 0 and not self.gpu_type:
            raise InvalidJobRequest(
                f"job {self.job_id}: asks for {self.gpus} GPU(s) per learner but no gpu_type; "
                "name the GPU type (e.g. gpu_type: V100)"
            )
        if self.max_nodes is not None and self.max_nodes < 1:
            raise InvalidJobRequest(
                f"job {self.job_id}: max_nodes={self.max_nodes}; use a number >= 1 or leave it out"
            )

    @property
    def pool(self) -> str:
        """The queue a job waits in: its GPU type, or ``cpu`` for CPU-only jobs."""
        return self.gpu_type if self.gpus > 0 else "cpu"

    @property
    def total_gpus(self) -> int:
        return self.learners * self.gpus

    def describe(self) -> str:
        """The demand in words: '2 learners × 4 V100 (8 CPUs, 16384 MB each) on ≤ 2 nodes'."""
        plural = "s" if self.learners != 1 else ""
        head = f"{self.learners} learner{plural}"
        extras = []
        if self.cpus:
            extras.append(f"{self.cpus:g} CPUs")
        if self.memory_mb:
            extras.append(f"{self.memory_mb:g} MB")
        if self.gpus:
            head += f" × {self.gpus} {self.gpu_type}"
            if extras:
                head += f" ({', '.join(extras)} each)"
        elif extras:
            head += f" × {', '.join(extras)}"
        if self.max_nodes is not None:
            head += f" on ≤ {self.max_nodes} node{'s' if self.max_nodes != 1 else ''}"
        return head

    def to_doc(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "learners": self.learners,
            "gpus": self.gpus,
            "gpu_type": self.gpu_type,
            "cpus": self.cpus,
            "memory_mb": self.memory_mb,
            "owner": self.owner,
            "priority": self.priority,
            "arrival": self.arrival,
            "max_nodes": self.max_nodes,
            "zone_aware": self.zone_aware,
            "node_selector": dict(self.node_selector),
        }

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> JobRequest:
        return cls(
            job_id=str(doc["job_id"]),
            learners=int(doc["learners"]),
            gpus=int(doc.get("gpus", 0)),
            gpu_type=str(doc.get("gpu_type", "")),
            cpus=float(doc.get("cpus", 0.0)),
            memory_mb=float(doc.get("memory_mb", 0.0)),
            owner=str(doc.get("owner", "")),
            priority=int(doc.get("priority", 0)),
            arrival=float(doc.get("arrival", 0.0)),
            max_nodes=None if doc.get("max_nodes") is None else int(doc["max_nodes"]),
            zone_aware=bool(doc.get("zone_aware", False)),
            node_selector={str(k): str(v) for k, v in dict(doc.get("node_selector") or {}).items()},
        )


def gpus_from_float(job_id: str, gpus: float) -> int:
    """Resources.gpus is a double on the wire; the scheduler only hands out whole GPUs."""
    if not math.isfinite(gpus) or gpus < 0 or gpus != int(gpus):
        raise InvalidJobRequest(
            f"job {job_id}: gpus={gpus!r} per learner; fractional GPUs are not supported, "
            "use a whole number >= 0"
        )
    return int(gpus)


@dataclass(frozen=True)
class Assignment:
    """One gang placement proposed by a policy: ``learner_nodes[rank]`` is a node index."""

    learner_nodes: tuple[int, ...]
    cost: float
    zone_conflicts: int = 0


@dataclass(frozen=True)
class Placement:
    """A whole gang placed: ``learner_nodes[rank]`` is the node name of learner ``rank``."""

    job_id: str
    learner_nodes: tuple[str, ...]
    placed_at: float
    policy: str
    borrowing: bool = False

    @property
    def nodes(self) -> list[str]:
        return sorted(set(self.learner_nodes))


@dataclass(frozen=True)
class AdmitResult:
    admitted: bool
    reason: str = ""
    error: str = ""  # the exception class name when refused, for callers that map codes


@dataclass(frozen=True)
class ScheduleResult:
    """What one scheduling pass decided.

    ``preempted`` lists jobs that borrowed quota and must now be halted (not lost): their
    resources are already released here and they are queued again to resume later.
    """

    placements: list[Placement] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Running elastic jobs the scaling policy resizes: job id -> (learners, reason). The
    # service asks each job's guardian to scale; a shrink frees its resources only once
    # the job runs on fewer learners (``GangScheduler.resize``).
    resize: dict[str, tuple[int, str]] = field(default_factory=dict)
    # preempted job id -> the job it made room for (the history says who and why)
    preempted_for: dict[str, JobRequest] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeView:
    name: str
    gpu_type: str
    gpus_total: int
    gpus_free: int
    cpus_total: float
    cpus_free: float
    memory_mb_total: float
    memory_mb_free: float
    zone: str
    labels: Mapping[str, str]
    price_per_hour: float = 0.0  # $ per node-hour from the cluster config; 0: not priced


@dataclass(frozen=True)
class ClusterView:
    nodes: list[NodeView]
    queued_jobs: int
    running_jobs: int


class PlacementPolicy(abc.ABC):
    """Turns a gang request and the cluster's free resources into an Assignment, or None.

    A policy only proposes; the scheduler allocates. It must be deterministic for a
    given ``rng`` state and must never propose more than a node's free resources.
    """

    name: str = ""

    @abc.abstractmethod
    def place(
        self, cluster: Cluster, job: JobRequest, rng: np.random.Generator
    ) -> Assignment | None:
        """Propose a placement of the whole gang, or None when it cannot fit now."""


class PlacementStore(abc.ABC):
    """Where the scheduler persists its records (one document per job) to survive restarts."""

    @abc.abstractmethod
    def save(self, doc: Mapping[str, Any]) -> None:
        """Insert or replace the document of ``doc['job_id']``."""

    @abc.abstractmethod
    def delete(self, job_id: str) -> None:
        """Forget a job (idempotent)."""

    @abc.abstractmethod
    def load_all(self) -> Iterable[Mapping[str, Any]]:
        """Every saved document, in the order the jobs were first saved."""


# -- the gangs of an elastic job's scale-outs ----------------------------------------------
# Learners added to a running elastic job are a gang of their own (`<job>+scale-<n>`),
# placed all-or-nothing under the job owner's quota like any job; the job's record lists
# the gangs it holds (`placement.scale_gangs`), and the scheduling loop releases a gang
# that its job no longer lists or that belongs to a job which stopped running.
SCALE_GANG_MARK = "+scale-"


def scale_gang_id(job_id: str, seq: int) -> str:
    return f"{job_id}{SCALE_GANG_MARK}{seq}"


def scale_gang_parent(gang_id: str) -> str | None:
    """The job a scale gang belongs to; None for a job's own gang."""
    parent, mark, _ = gang_id.rpartition(SCALE_GANG_MARK)
    return parent if mark else None
