"""GangScheduler: admission, queue, gang placement, quotas, preemption, explanations.

The one object the service wraps and the simulator drives. All learners of a job are
placed or none; a queued job holds nothing; GPUs are never over-committed (the
cluster model refuses it). Every change is written to the PlacementStore before the
call returns, so a restarted scheduler reloads its queue and reservations instead of
losing or double-booking them. Not thread-safe: callers serialize (the service holds
a lock).
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from services.scheduler import explain as explain_mod
from services.scheduler.api import (
    DEFAULT_BATCH_WINDOW_S,
    AdmitResult,
    Assignment,
    ClusterView,
    InvalidJobRequest,
    JobRequest,
    JobTooLarge,
    NoRoomForLearner,
    OverCommitError,
    Placement,
    PlacementPolicy,
    PlacementStore,
    SchedState,
    SchedulerError,
    ScheduleResult,
    UnknownJob,
    scale_gang_parent,
)
from services.scheduler.cluster import Cluster, Node
from services.scheduler.elasticity.api import ScalingPolicy
from services.scheduler.elasticity.driver import ElasticDriver
from services.scheduler.placement import get_policy
from services.scheduler.queue import JobQueue, QueueOrder
from services.scheduler.quota import QuotaClass, QuotaConfig, QuotaLedger

log = logging.getLogger(__name__)

# How long a node where a straggler was reported is left out of placements (if the gang
# fits elsewhere): long enough for the next placements, short enough that a node slowed
# by a passing neighbour comes back.
STRAGGLER_AVOID_S = 600.0
# The attained service of jobs that left the scheduler (halted in the daemon, which
# releases them) is remembered for their return (a resume): at most this many, oldest
# forgotten first (most of them ended for good and never come back).
ATTAINED_REMEMBERED = 10_000


@dataclass
class JobRecord:
    job: JobRequest
    state: SchedState
    seq: int
    batch: int
    placement: Placement | None = None
    learner_idx: tuple[int, ...] = ()
    preemptions: int = 0
    blocked_by: str | None = None
    # elastic jobs asked to shrink to make room for this one (a scaling policy)
    waiting_for_shrink: tuple[str, ...] = ()
    # Attained service (Tiresias): GPU·s (learner·s for CPU-only jobs) of its placements,
    # learners × max(1, gpus) × seconds placed, banked up to `banked_at` (when a placement
    # ended or changed size); the running placement adds the time since.
    attained_gpu_s: float = 0.0
    banked_at: float | None = None

    def gpu_rate(self) -> int:
        """GPU·s it attains per second while placed."""
        return self.job.learners * max(1, self.job.gpus)

    def attained(self, now: float) -> float:
        """GPU·s attained so far: the banked service plus the running placement's."""
        if self.placement is None:
            return self.attained_gpu_s
        since = max(self.placement.placed_at, self.banked_at or self.placement.placed_at)
        return self.attained_gpu_s + max(0.0, now - since) * self.gpu_rate()

    def bank(self, now: float) -> None:
        """Add up the running placement's service so far (its end, or a change of size)."""
        self.attained_gpu_s = self.attained(now)
        self.banked_at = now if self.placement is not None else None

    def to_doc(self) -> dict[str, Any]:
        p = self.placement
        return {
            "job_id": self.job.job_id,
            "state": str(self.state),
            "request": self.job.to_doc(),
            "seq": self.seq,
            "batch": self.batch,
            "learner_nodes": list(p.learner_nodes) if p else [],
            "placed_at": p.placed_at if p else None,
            "policy": p.policy if p else "",
            "borrowing": p.borrowing if p else False,
            "preemptions": self.preemptions,
            "attained_gpu_s": self.attained_gpu_s,
            "banked_at": self.banked_at,
        }


def _shape(job: JobRequest) -> tuple[Any, ...]:
    """What placement depends on: two jobs of one shape fit or fail alike."""
    return (
        job.pool,
        job.learners,
        job.gpus,
        job.cpus,
        job.memory_mb,
        job.max_nodes,
        job.zone_aware,
        tuple(sorted(job.node_selector.items())),
    )


class GangScheduler:
    """See the module docstring. ``policy`` is a registered name or a PlacementPolicy."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        policy: str | PlacementPolicy = "pack",
        policy_options: Mapping[str, Any] | None = None,
        quotas: QuotaConfig | None = None,
        seed: int = 0,
        backfill: bool = False,
        batch_window_s: float = DEFAULT_BATCH_WINDOW_S,
        store: PlacementStore | None = None,
        clock: Callable[[], float] = time.time,
        scaling: ScalingPolicy | None = None,
    ) -> None:
        self.cluster = cluster
        self.policy = (
            get_policy(policy, **dict(policy_options or {})) if isinstance(policy, str) else policy
        )
        self.ledger = QuotaLedger(quotas)
        self.seed = seed
        self.backfill = backfill
        # a scaling policy that orders the queue (Elastic-Tiresias) gives its key; any
        # other keeps the FCFS order (services/scheduler/queue.py)
        self.queue = JobQueue(
            batch_window_s, order=scaling if isinstance(scaling, QueueOrder) else None
        )
        self.store = store
        self.clock = clock
        self.records: dict[str, JobRecord] = {}
        self.restored_reservations: list[str] = []
        self.avoided: dict[str, float] = {}  # node name -> until when (stragglers)
        # job id -> GPU·s attained, for jobs that left (see ATTAINED_REMEMBERED)
        self.attained_left: dict[str, float] = {}
        # running elastic jobs resized by the scaling policy (services/scheduler/elasticity)
        self.elasticity = ElasticDriver(self, scaling)
        if store is not None:
            self._restore(store.load_all())

    # -- admission ---------------------------------------------------------------------

    def check(self, job: JobRequest) -> None:
        """Raise if the job can never run here (bad request, unknown type, too large)."""
        job.validate()
        self.cluster.check_gpu_type(job)
        cap = self.cluster.capacity(job, empty=True)
        total = int(cap.sum())
        if total < job.learners:
            raise JobTooLarge(
                f"job {job.job_id} can never run on this cluster: it needs {job.describe()}, "
                f"and even the empty cluster has room for only {total} such learner"
                f"{'s' if total != 1 else ''}; ask for fewer or smaller learners"
            )
        if job.max_nodes is not None:
            top = int(np.sort(cap)[::-1][: job.max_nodes].sum())
            if top < job.learners:
                raise JobTooLarge(
                    f"job {job.job_id} can never run on this cluster: it needs {job.describe()}, "
                    f"but the {job.max_nodes} largest nodes hold only {top} such learners"
                )
        reason = self.ledger.never_fits(job)
        if reason:
            raise JobTooLarge(f"job {job.job_id} can never run: {reason}")

    def admit(self, job: JobRequest) -> AdmitResult:
        """Would this job be accepted? Refuses, with the reason, what can never fit."""
        try:
            self.check(job)
        except SchedulerError as exc:
            return AdmitResult(False, str(exc), type(exc).__name__)
        return AdmitResult(True)

    def enqueue(self, job: JobRequest, attained_gpu_s: float = 0.0) -> None:
        """Queue an admitted job. Re-submitting the same request is a no-op.
        `attained_gpu_s`: the service it attained before, as its stored record says (a
        resumed job, after a restart of the scheduler that released it)."""
        existing = self.records.get(job.job_id)
        if existing is not None:
            if replace(existing.job, arrival=job.arrival) == job:
                return
            raise InvalidJobRequest(
                f"job {job.job_id} is already known with a different request; use a new job id"
            )
        self.check(job)
        # a job that comes back (a resume after a halt) keeps the service it attained
        attained = max(self.attained_left.pop(job.job_id, 0.0), attained_gpu_s)
        entry = self.queue.push(job, attained_gpu_s=attained)
        rec = JobRecord(job, SchedState.QUEUED, entry.seq, entry.batch, attained_gpu_s=attained)
        self.records[job.job_id] = rec
        self._save(rec)

    def submit(self, job: JobRequest) -> AdmitResult:
        """admit + enqueue: the submit-time call."""
        result = self.admit(job)
        if result.admitted:
            self.enqueue(job)
        return result

    # -- scheduling --------------------------------------------------------------------

    def _rng(self, job_id: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(job_id.encode())])

    def _propose(self, job: JobRequest) -> Assignment | None:
        avoid = self._avoided_now()
        if avoid:
            # nodes where a straggler was reported: a preference, not a constraint
            self.cluster.avoided = avoid
            try:
                assignment = self.policy.place(self.cluster, job, self._rng(job.job_id))
            finally:
                self.cluster.avoided = set()
            if assignment is not None:
                return assignment
        return self.policy.place(self.cluster, job, self._rng(job.job_id))

    def _avoided_now(self) -> set[int]:
        if not self.avoided:
            return set()
        now = self.clock()
        for name, until in list(self.avoided.items()):
            if until <= now:
                del self.avoided[name]
        return {self.cluster.index[n] for n in self.avoided if n in self.cluster.index}

    def avoid_node(self, name: str, for_s: float = STRAGGLER_AVOID_S) -> None:
        """A learner on ``name`` was persistently slower than its gang (a straggler,
        reported by its guardian): placements leave the node out for ``for_s`` seconds
        when they fit elsewhere."""
        self.avoided[name] = max(self.avoided.get(name, 0.0), self.clock() + for_s)

    def schedule(self, now: float | None = None) -> ScheduleResult:
        """Place whole gangs from the queue; returns placements and jobs to halt."""
        now = self.clock() if now is None else now
        placements: list[Placement] = []
        preempted: list[str] = []
        blocked: dict[str, str] = {}  # pool -> the job at its head that could not fit
        # pool -> the first borrower that could not fit: it holds back later borrowers
        # only. A job within its owner's quota goes on past it (and may preempt borrowers
        # to fit): a borrower at the head must not keep the quota's owner from its GPUs.
        borrowers_blocked: dict[str, str] = {}
        # Free resources only shrink during a pass (until a preemption), so a shape that
        # failed once fails again: skip the policy for it. Keeps per-pod passes cheap.
        failed_shapes: set[tuple[Any, ...]] = set()
        resize: dict[str, tuple[int, str]] = {}
        preempted_for: dict[str, JobRequest] = {}
        ordered = self.queue.ordered()
        pending: dict[str, int] = {}
        for entry in ordered:
            pending[entry.job.pool] = pending.get(entry.job.pool, 0) + 1
        self.elasticity.expire(now)
        for entry in ordered:
            job = entry.job
            rec = self.records[job.job_id]
            if job.job_id in preempted:
                continue  # halted in this pass: do not move it elsewhere at once
            if job.pool in blocked and not self.backfill:
                rec.blocked_by = blocked[job.pool]
                continue
            cls = self.ledger.classify(job)
            if cls in (QuotaClass.OVER_LIMIT, QuotaClass.OVER_QUOTA):
                rec.blocked_by = None
                continue  # its owner's business: it does not hold the pool back
            if cls == QuotaClass.BORROW and job.pool in borrowers_blocked and not self.backfill:
                rec.blocked_by = borrowers_blocked[job.pool]
                continue
            shape = _shape(job)
            assignment = None if shape in failed_shapes else self._propose(job)
            victims: list[str] = []
            if assignment is None:
                # elastic jobs shrink (a scaling policy) before anyone is preempted
                waits, asked = self.elasticity.shrink_for(job, pending[job.pool], now)
                resize.update(asked)
                if waits:
                    rec.waiting_for_shrink = tuple(self.elasticity.waiting_on(job.pool))
                    blocked.setdefault(job.pool, job.job_id)
                    rec.blocked_by = None
                    continue
            rec.waiting_for_shrink = ()
            if assignment is None and cls == QuotaClass.GUARANTEED and self.ledger.config:
                # borrowing elastic jobs shrink first; whole gangs are preempted only if
                # that cannot make room
                waits, asked = self.elasticity.shrink_borrowers(job, now)
                resize.update(asked)
                if waits:
                    rec.waiting_for_shrink = tuple(self.elasticity.waiting_on(job.pool))
                    blocked.setdefault(job.pool, job.job_id)
                    rec.blocked_by = None
                    continue
                assignment, victims = self._place_by_preemption(job, now)
                if victims:
                    failed_shapes.clear()
            if assignment is None:
                failed_shapes.add(shape)
                if cls == QuotaClass.BORROW:
                    borrowers_blocked.setdefault(job.pool, job.job_id)
                else:
                    blocked.setdefault(job.pool, job.job_id)
                rec.blocked_by = None
                continue
            for victim in victims:
                self._requeue_preempted(victim, now)
                preempted.append(victim)
                preempted_for[victim] = job
            placements.append(self._commit(rec, assignment, cls == QuotaClass.BORROW, now))
        if self.elasticity.active:
            # capacity nobody waits for: elastic jobs of pools with an empty queue grow
            idle_pools = {r.job.pool for r in self.records.values()} - {
                e.job.pool for e in self.queue.ordered()
            }
            resize.update(self.elasticity.grow(idle_pools, now))
        return ScheduleResult(placements, preempted, resize, preempted_for)

    def _commit(
        self, rec: JobRecord, assignment: Assignment, borrowing: bool, now: float
    ) -> Placement:
        job = rec.job
        self.cluster.allocate(job, assignment.learner_nodes)
        self.ledger.charge(job, borrowing)
        self.queue.remove(job.job_id)
        names = tuple(self.cluster.nodes[i].name for i in assignment.learner_nodes)
        rec.placement = Placement(job.job_id, names, now, self.policy.name, borrowing)
        rec.learner_idx = assignment.learner_nodes
        rec.state = SchedState.RESERVED
        rec.blocked_by = None
        self._save(rec)
        return rec.placement

    def _place_by_preemption(
        self, job: JobRequest, now: float
    ) -> tuple[Assignment | None, list[str]]:
        """Free borrowed GPUs of the job's type, cheapest victims first, until the gang fits:
        lowest priority first, then the one that loses the least work since its last
        checkpoint (``note_checkpoint``; a job that never reported one loses everything
        since it was placed), then the most recently placed."""
        victims = [
            r
            for r in self.records.values()
            if r.placement is not None
            and r.placement.borrowing
            and r.job.gpu_type == job.gpu_type
            and r.job.gpus > 0
        ]
        victims.sort(
            key=lambda r: (
                r.job.priority,
                self.elasticity.lost_work(r, now),
                -(r.placement.placed_at if r.placement else 0),
                -r.seq,
            )
        )
        released: list[JobRecord] = []
        for victim in victims:
            self.cluster.release(victim.job.job_id)
            released.append(victim)
            assignment = self._propose(job)
            if assignment is not None:
                return assignment, [v.job.job_id for v in released]
        for victim in released:  # nothing gained: put them back exactly where they were
            self.cluster.allocate(victim.job, victim.learner_idx)
        return None, []

    def _requeue_preempted(self, job_id: str, now: float) -> None:
        rec = self.records[job_id]
        assert rec.placement is not None
        self.ledger.refund(rec.job, rec.placement.borrowing)
        rec.bank(now)
        rec.placement = None
        rec.banked_at = None
        rec.learner_idx = ()
        rec.state = SchedState.QUEUED
        rec.preemptions += 1
        # re-keyed with the service it attained (Tiresias: it may go down a queue)
        self.queue.push(rec.job, seq=rec.seq, batch=rec.batch, attained_gpu_s=rec.attained_gpu_s)
        self._save(rec)

    # -- lifecycle after placement -------------------------------------------------------

    def confirm(self, job_id: str) -> None:
        """The job's learners are visible: the reservation becomes a binding."""
        rec = self._record(job_id)
        if rec.state == SchedState.QUEUED:
            raise InvalidJobRequest(f"job {job_id} is queued, not placed; nothing to confirm")
        if rec.state != SchedState.BOUND:
            rec.state = SchedState.BOUND
            self._save(rec)

    def release(self, job_id: str, now: float | None = None) -> bool:
        """Forget a job (finished, failed, deleted, halted): free what it holds. False if
        unknown. The service it attained is added up: a scale gang's goes to its job, a
        job's is remembered for its return (a resume of a halted job)."""
        self.elasticity.forget(job_id)
        rec = self.records.pop(job_id, None)
        if rec is None:
            return False
        self.queue.remove(job_id)
        attained = rec.attained(self.clock() if now is None else now)
        parent = scale_gang_parent(job_id)
        if parent is None:
            self._remember_attained(job_id, attained)
        elif parent in self.records:
            self.records[parent].attained_gpu_s += attained
        if rec.placement is not None:
            self.cluster.release(job_id)
            self.ledger.refund(rec.job, rec.placement.borrowing)
        if self.store is not None:
            self.store.delete(job_id)
        return True

    def _remember_attained(self, job_id: str, attained: float) -> None:
        if attained <= 0:
            return
        self.attained_left.pop(job_id, None)
        self.attained_left[job_id] = attained
        while len(self.attained_left) > ATTAINED_REMEMBERED:
            del self.attained_left[next(iter(self.attained_left))]

    def attained(self, job_id: str, now: float | None = None) -> float:
        """GPU·s a job attained so far: its own record (earlier placements included) and
        its scale gangs (an elastic job's, services/scheduler/elasticity). The one number
        the queue's Tiresias order and the scaling policy's queues both use."""
        now = self.clock() if now is None else now
        rec = self.records.get(job_id)
        if rec is None:
            return self.attained_left.get(job_id, 0.0)
        gangs = [
            r
            for gid, r in self.records.items()
            if scale_gang_parent(gid) == job_id and r.placement is not None
        ]
        return rec.attained(now) + sum(g.attained(now) for g in gangs)

    def place_now(self, job: JobRequest) -> Placement:
        """Place one gang at once, outside the queue (a scaling policy's growth, which it
        proposed because there is room): SchedulerError when it does not fit."""
        self.check(job)
        if job.job_id in self.records:
            raise InvalidJobRequest(f"job {job.job_id} is already known; use a new id")
        assignment = self._propose(job)
        if assignment is None:
            raise NoRoomForLearner(f"no room for {job.job_id} ({job.describe()}) now")
        rec = JobRecord(job, SchedState.QUEUED, -1, -1)
        self.records[job.job_id] = rec
        cls = self.ledger.classify(job)
        return self._commit(rec, assignment, cls == QuotaClass.BORROW, self.clock())

    def set_elastic(self, job_id: str, min_learners: int, max_learners: int) -> None:
        """A placed job is elastic (manifest ``elastic: {min, max}``): the scaling policy
        may resize it within these bounds."""
        if not 1 <= min_learners <= max_learners:
            raise InvalidJobRequest(
                f"job {job_id}: elastic bounds [{min_learners}, {max_learners}]; "
                "need 1 <= min <= max"
            )
        self.elasticity.set_bounds(job_id, min_learners, max_learners)

    def note_checkpoint(self, job_id: str, committed_at: float) -> None:
        """A placed job's latest checkpoint was committed at this (wall-clock) time: a
        preemption would lose only the work since then."""
        self.elasticity.checkpoints[job_id] = committed_at

    def resize(self, job_id: str, learners: int) -> bool:
        """A running job now runs on ``learners`` (fewer than it holds: a scale-in was
        applied): free the rest. True if anything was freed."""
        return self.elasticity.resize(job_id, learners)

    def job_size(self, job_id: str) -> int:
        """The learners a placed job holds: its own gang plus its scale gangs."""
        return self.elasticity.size(job_id)

    def shrink_record(self, rec: JobRecord, learners: int) -> None:
        """Keep the first ``learners`` learners of a placed record (its lowest ranks)."""
        assert rec.placement is not None and 0 < learners < rec.job.learners
        borrowing = rec.placement.borrowing
        self.cluster.release(rec.job.job_id)
        self.ledger.refund(rec.job, borrowing)
        rec.bank(self.clock())  # the service at the old size, before it shrinks
        rec.job = replace(rec.job, learners=learners)
        rec.learner_idx = rec.learner_idx[:learners]
        self.cluster.allocate(rec.job, rec.learner_idx)
        self.ledger.charge(rec.job, borrowing)
        rec.placement = replace(rec.placement, learner_nodes=rec.placement.learner_nodes[:learners])
        self._save(rec)

    def replace_nodes(self, nodes: Sequence[Node]) -> list[str]:
        """The cluster's nodes changed (a cluster source reported a node added, removed,
        cordoned): rebuild the model and keep each placement whose nodes are still there.
        Returns the placed jobs whose nodes left the model; they keep their records (the
        backend reports their learners' fate) but hold nothing in it. Raises
        ClusterConfigError, changing nothing, when no node is left."""
        cluster = Cluster(nodes)
        gone: list[str] = []
        for rec in self.records.values():
            if rec.placement is None:
                continue
            try:
                idx = tuple(cluster.index[n] for n in rec.placement.learner_nodes)
                cluster.allocate(rec.job, idx)
            except (KeyError, OverCommitError):
                gone.append(rec.job.job_id)
                idx = ()
            rec.learner_idx = idx
        self.cluster = cluster
        return gone

    def replace_learner(self, job_id: str, rank: int) -> Placement:
        """A gang of one for a placed job's lost learner ``rank`` (a pipeline job's
        replacement), instead of reusing the lost learner's allocation: its share is
        given back and one learner of the same resources is placed on another node (a
        learner lost to a preemption points at its node, which may be going away). The
        job's quota charge does not change (same learner count). Raises
        ``NoRoomForLearner`` (the allocation unchanged) when no other node has room now,
        ``UnknownJob``, or ``InvalidJobRequest`` (not placed, no such rank)."""
        rec = self._record(job_id)
        job = rec.job
        if rec.placement is None:
            raise InvalidJobRequest(f"job {job_id} is not placed; nothing to replace")
        if not 0 <= rank < job.learners:
            raise InvalidJobRequest(
                f"job {job_id} has learners 0..{job.learners - 1}; no learner {rank}"
            )
        old = rec.learner_idx
        self.cluster.release(job_id)
        # what the other learners keep stays held while the one learner is placed
        others = replace(job, job_id=f"{job_id}#others", learners=job.learners - 1)
        if others.learners:
            self.cluster.allocate(others, old[:rank] + old[rank + 1 :])
        one = replace(job, learners=1, max_nodes=None, zone_aware=False)
        cap = self.cluster.capacity(one)
        if others.learners:
            self.cluster.release(others.job_id)
        lost = old[rank]
        fits = [i for i in range(len(cap)) if cap[i] > 0 and i != lost]
        if not fits:
            self.cluster.allocate(job, old)
            raise NoRoomForLearner(
                f"job {job_id}: no node other than {self.cluster.nodes[lost].name} (where "
                f"learner {rank} was lost) has room for one learner ({one.describe()}) now; "
                "the replacement waits until one has"
            )
        new = (*old[:rank], fits[0], *old[rank + 1 :])
        self.cluster.allocate(job, new)
        names = tuple(self.cluster.nodes[i].name for i in new)
        rec.placement = replace(rec.placement, learner_nodes=names)
        rec.learner_idx = new
        self._save(rec)
        return rec.placement

    # -- views -------------------------------------------------------------------------

    def _record(self, job_id: str) -> JobRecord:
        try:
            return self.records[job_id]
        except KeyError:
            raise UnknownJob(f"the scheduler has no job {job_id!r}") from None

    def state(self, job_id: str) -> SchedState:
        return self._record(job_id).state

    def placement(self, job_id: str) -> Placement | None:
        return self._record(job_id).placement

    def placements(self) -> list[Placement]:
        return [r.placement for r in self.records.values() if r.placement is not None]

    def queued(self) -> list[str]:
        return [e.job.job_id for e in self.queue.ordered()]

    def explain(self, job_id: str) -> str:
        rec = self._record(job_id)
        if rec.placement is None and rec.waiting_for_shrink:
            return (
                f"waiting for elastic job{'s' * (len(rec.waiting_for_shrink) > 1)} "
                f"{', '.join(rec.waiting_for_shrink)} to shrink (scaling policy "
                f"{self.elasticity.policy.name}): it needs {rec.job.describe()}"
            )
        if rec.placement is not None:
            return explain_mod.placed_reason(
                rec.job,
                rec.placement.learner_nodes,
                bound=rec.state == SchedState.BOUND,
                borrowing=rec.placement.borrowing,
            )
        entry = self.queue.get(job_id)
        order = self.queue.order
        return explain_mod.queued_reason(
            rec.job,
            self.cluster,
            self.ledger,
            ahead=self.queue.ahead_of(job_id),
            blocked_by=rec.blocked_by,
            preemptions=rec.preemptions,
            order_note=order.queue_note(entry) if order is not None and entry else None,
        )

    def cluster_view(self) -> ClusterView:
        running = sum(1 for r in self.records.values() if r.placement is not None)
        return ClusterView(self.cluster.node_views(), len(self.queue), running)

    # -- persistence -------------------------------------------------------------------

    def _save(self, rec: JobRecord) -> None:
        if self.store is not None:
            self.store.save(rec.to_doc())

    def _restore(self, docs: Iterable[Mapping[str, Any]]) -> None:
        """Rebuild queue and allocations; a reservation that no longer fits is re-queued."""
        for doc in docs:
            job = JobRequest.from_doc(doc["request"])
            rec = JobRecord(
                job,
                SchedState.QUEUED,
                int(doc.get("seq", 0)),
                int(doc.get("batch", 0)),
                preemptions=int(doc.get("preemptions", 0)),
                attained_gpu_s=float(doc.get("attained_gpu_s") or 0.0),
            )
            self.records[job.job_id] = rec
            state = SchedState(str(doc.get("state", "queued")))
            names = [str(n) for n in doc.get("learner_nodes") or []]
            if state != SchedState.QUEUED and names:
                try:
                    idx = tuple(self.cluster.index[n] for n in names)
                    self.cluster.allocate(job, idx)
                except (KeyError, OverCommitError) as exc:
                    log.warning(
                        "re-queueing job %s: its reservation no longer fits (%s)", job.job_id, exc
                    )
                else:
                    borrowing = bool(doc.get("borrowing", False))
                    self.ledger.charge(job, borrowing)
                    rec.state = state
                    rec.learner_idx = idx
                    rec.placement = Placement(
                        job.job_id,
                        tuple(names),
                        float(doc.get("placed_at") or 0.0),
                        str(doc.get("policy", "")),
                        borrowing,
                    )
                    banked_at = doc.get("banked_at")
                    rec.banked_at = float(banked_at) if banked_at is not None else None
                    if state == SchedState.RESERVED:
                        self.restored_reservations.append(job.job_id)
                    continue
            self.queue.push(job, seq=rec.seq, batch=rec.batch, attained_gpu_s=rec.attained_gpu_s)
            if state != SchedState.QUEUED:
                self._save(rec)
