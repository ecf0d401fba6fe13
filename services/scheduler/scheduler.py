"""GangScheduler: admission, queue, gang placement, quotas, preemption, explanations.

The one object the service wraps and the simulator drives. All learners of a job are
placed or none; a queued job holds nothing; GPUs are never over-committed (the
cluster model refuses it). Every change is written to the PlacementStore before the
call returns, so a restarted scheduler reloads its queue and reservations instead of
losing or double-booking them. Not thread-safe: callers serialize (the service holds
a lock).
"""

from __future__ import annotations

import contextlib
import logging
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
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
from services.scheduler.queue import JobQueue, QueueEntry, QueueOrder, SortKey
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
# Jobs that passed `admit` (the API's submit-time check) and were not queued yet: their
# `enqueue`, moments later, does not check them a second time (issue #18). At most this
# many, oldest forgotten first (a job whose store write failed is never queued); a job
# forgotten is checked again.
ADMITTED_REMEMBERED = 4096
# A pass over the new jobs only (`GangScheduler._resume`) is exact, but a pass over the
# whole queue runs at least this often anyway: what a placement policy could decide
# differently with time (nodes avoided for a while) is looked at again.
FULL_PASS_INTERVAL_S = 1.0
# Job shapes (learners and what each asks for) whose room on the empty cluster `check`
# remembers, at most; then it starts over.
ROOM_SHAPES_REMEMBERED = 1024


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


@dataclass
class _Pass:
    """What a scheduling pass knows as it walks the queue in order (`GangScheduler.
    _consider`), and what it decided."""

    now: float
    pending: dict[str, int] = field(default_factory=dict)  # pool -> jobs queued
    # pool -> the job at its head that could not fit
    blocked: dict[str, str] = field(default_factory=dict)
    # pool -> the first borrower that could not fit: it holds back later borrowers
    # only. A job within its owner's quota goes on past it (and may preempt borrowers
    # to fit): a borrower at the head must not keep the quota's owner from its GPUs.
    borrowers_blocked: dict[str, str] = field(default_factory=dict)
    # Free resources only shrink during a pass (until a preemption), so a shape that
    # failed once fails again: skip the policy for it. Keeps per-pod passes cheap.
    failed_shapes: set[tuple[Any, ...]] = field(default_factory=set)
    placements: list[Placement] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    resize: dict[str, tuple[int, str]] = field(default_factory=dict)
    preempted_for: dict[str, JobRequest] = field(default_factory=dict)

    def carry_on(self, now: float) -> _Pass:
        """A pass that starts where this one ended (`GangScheduler._resume`)."""
        return _Pass(
            now,
            dict(self.pending),
            dict(self.blocked),
            dict(self.borrowers_blocked),
            set(self.failed_shapes),
        )

    def result(self) -> ScheduleResult:
        return ScheduleResult(self.placements, self.preempted, self.resize, self.preempted_for)


@dataclass(frozen=True)
class _LastPass:
    """The last pass, kept for the next one to carry on from (`GangScheduler._resume`):
    its state at the end, the `_fingerprint` then, the queue's last key then, and when
    the last pass over the whole queue was."""

    walk: _Pass
    fingerprint: tuple[int, int, int, int]
    tail: SortKey | None
    full_at: float


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
        incremental: bool = True,
    ) -> None:
        """``incremental``: a pass may carry on from the last one over the jobs queued
        since (`_resume`); False walks the whole queue every pass (the tests compare)."""
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
        # the records that hold a placement: `placements()` without a walk of the queue
        self._placed: dict[str, JobRecord] = {}
        # job id -> (the request `admit` accepted, on which cluster model): see
        # ADMITTED_REMEMBERED
        self._admitted: OrderedDict[str, tuple[JobRequest, Cluster]] = OrderedDict()
        # `_room_when_empty`'s answers, for the cluster model they were worked out on
        self._room: tuple[Cluster | None, dict[tuple[Any, ...], tuple[int, int]]] = (None, {})
        self.incremental = incremental
        self.full_pass_interval_s = FULL_PASS_INTERVAL_S
        self._arrived: list[QueueEntry] = []  # queued since the last pass
        self._last_pass: _LastPass | None = None
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
        total, top = self._room_when_empty(job)
        if total < job.learners:
            raise JobTooLarge(
                f"job {job.job_id} can never run on this cluster: it needs {job.describe()}, "
                f"and even the empty cluster has room for only {total} such learner"
                f"{'s' if total != 1 else ''}; ask for fewer or smaller learners"
            )
        if job.max_nodes is not None and top < job.learners:
            raise JobTooLarge(
                f"job {job.job_id} can never run on this cluster: it needs {job.describe()}, "
                f"but the {job.max_nodes} largest nodes hold only {top} such learners"
            )
        reason = self.ledger.never_fits(job)
        if reason:
            raise JobTooLarge(f"job {job.job_id} can never run: {reason}")

    def _room_when_empty(self, job: JobRequest) -> tuple[int, int]:
        """How many learners of the job's shape the empty cluster holds, and its
        `max_nodes` largest nodes (the whole cluster without a bound). The same for every
        job of one shape on one cluster model, so worked out once: the arrays cost ~50 µs
        of the daemon's CPU a submit (issue #18). Called without the lock (`admit`): two
        callers at once work out the same answer."""
        cluster = self.cluster
        seen_on, room = self._room
        if seen_on is not cluster or len(room) >= ROOM_SHAPES_REMEMBERED:
            room = {}
            self._room = (cluster, room)
        shape = (
            job.learners,
            job.gpus,
            job.gpu_type,
            job.cpus,
            job.memory_mb,
            job.max_nodes,
            tuple(sorted(job.node_selector.items())),
        )
        known = room.get(shape)
        if known is None:
            cap = cluster.capacity(job, empty=True)
            total = int(cap.sum())
            top = total if job.max_nodes is None else int(np.sort(cap)[::-1][: job.max_nodes].sum())
            known = room[shape] = (total, top)
        return known

    def admit(self, job: JobRequest) -> AdmitResult:
        """Would this job be accepted? Refuses, with the reason, what can never fit. An
        accepted job's `enqueue` of the same request does not check it again. Safe to
        call without the lock the other calls are serialized by (the service does): it
        reads only what a pass does not change (the empty cluster, the quota config)."""
        try:
            self.check(job)
        except SchedulerError as exc:
            return AdmitResult(False, str(exc), type(exc).__name__)
        self._admitted[job.job_id] = (job, self.cluster)
        if len(self._admitted) > ADMITTED_REMEMBERED:
            with contextlib.suppress(KeyError):  # emptied by another thread meanwhile
                self._admitted.popitem(last=False)
        return AdmitResult(True)

    def _admitted_before(self, job: JobRequest) -> bool:
        """Did `admit` accept this very request (its arrival aside) on this cluster model?
        Forgets it: a job is queued once."""
        seen = self._admitted.pop(job.job_id, None)
        return (
            seen is not None
            and seen[1] is self.cluster
            and replace(seen[0], arrival=job.arrival) == job
        )

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
        if not self._admitted_before(job):
            self.check(job)
        # a job that comes back (a resume after a halt) keeps the service it attained
        attained = max(self.attained_left.pop(job.job_id, 0.0), attained_gpu_s)
        entry = self.queue.push(job, attained_gpu_s=attained)
        rec = JobRecord(job, SchedState.QUEUED, entry.seq, entry.batch, attained_gpu_s=attained)
        self.records[job.job_id] = rec
        if self._last_pass is not None:  # else the next pass walks the whole queue anyway
            self._arrived.append(entry)
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
        self.elasticity.expire(now)
        arrived, self._arrived = self._arrived, []
        resumed = self._resume(arrived, now)
        if resumed is not None:
            return resumed
        ordered = self.queue.ordered()
        walk = _Pass(now)
        for entry in ordered:
            walk.pending[entry.job.pool] = walk.pending.get(entry.job.pool, 0) + 1
        for entry in ordered:
            self._consider(entry, walk)
        if self.elasticity.active:
            # capacity nobody waits for: elastic jobs of pools with an empty queue grow
            idle_pools = {r.job.pool for r in self.records.values()} - {
                e.job.pool for e in self.queue.ordered()
            }
            walk.resize.update(self.elasticity.grow(idle_pools, now))
        self._last_pass = self._resumable(walk, full_at=now)
        return walk.result()

    def _resume(self, arrived: list[QueueEntry], now: float) -> ScheduleResult | None:
        """The pass over the jobs queued since the last pass only, carrying on from where
        that one ended, when that is exactly what a pass over the whole queue would do
        (else None): nothing but new jobs changed since (no resources freed, no job left
        the queue, `_fingerprint`), each of them sorts after every job queued before it,
        and nothing (a scaling policy, elastic jobs, backfill) looks past a blocked job.
        A pass over the whole queue would then find every earlier job as the last pass
        left it (free resources only shrank since, so what did not fit still does not)
        and reach the new ones in the state it ended in. With thousands queued behind a
        full pool this is what keeps a submit's share of the passes from growing with
        the queue (issue #18: a pass per burst of pushes walked every queued job)."""
        last = self._last_pass
        if (
            last is None
            or not self.incremental
            or last.fingerprint != self._fingerprint()
            or now - last.full_at >= self.full_pass_interval_s
            or now < last.walk.now
        ):
            return None
        fresh = sorted(arrived, key=QueueEntry.sort_key)
        if fresh and last.tail is not None and fresh[0].key <= last.tail:
            return None  # a new job sorts ahead of one queued before: walk it all
        walk = last.walk.carry_on(now)
        for entry in fresh:
            walk.pending[entry.job.pool] = walk.pending.get(entry.job.pool, 0) + 1
        for entry in fresh:
            self._consider(entry, walk)
        self._last_pass = self._resumable(walk, full_at=last.full_at)
        return walk.result()

    def _resumable(self, walk: _Pass, full_at: float) -> _LastPass | None:
        """What the next pass may carry on from, or None when it must walk the whole
        queue: after a preemption or a resize (jobs went back to the queue, resources
        will be freed), and with quotas after any placement (a placed borrower is a
        victim, and its owner's usage reclassifies the jobs behind it)."""
        if (
            walk.preempted
            or walk.resize
            or self.backfill
            or self.elasticity.active
            or self.elasticity.bounds
            or self.elasticity.shrinking
            or self.elasticity.growing
            or (self.ledger.config is not None and walk.placements)
        ):
            return None
        return _LastPass(walk, self._fingerprint(), self.queue.last_key(), full_at)

    def _fingerprint(self) -> tuple[int, int, int, int]:
        """Changes that may let a queued job fit or change its turn: the cluster model
        replaced, resources allocated or freed, a quota charged or refunded, a job out
        of the queue or put back (a new job queued is not one: `_resume` takes it)."""
        return (id(self.cluster), self.cluster.changes, self.ledger.changes, self.queue.changes)

    def _consider(self, entry: QueueEntry, walk: _Pass) -> None:
        """One queued job's turn in a pass (`schedule`), in queue order."""
        job = entry.job
        rec = self.records[job.job_id]
        now = walk.now
        if job.job_id in walk.preempted:
            return  # halted in this pass: do not move it elsewhere at once
        if job.pool in walk.blocked and not self.backfill:
            rec.blocked_by = walk.blocked[job.pool]
            return
        cls = self.ledger.classify(job)
        if cls in (QuotaClass.OVER_LIMIT, QuotaClass.OVER_QUOTA):
            rec.blocked_by = None
            return  # its owner's business: it does not hold the pool back
        if cls == QuotaClass.BORROW and job.pool in walk.borrowers_blocked and not self.backfill:
            rec.blocked_by = walk.borrowers_blocked[job.pool]
            return
        shape = _shape(job)
        assignment = None if shape in walk.failed_shapes else self._propose(job)
        victims: list[str] = []
        if assignment is None:
            # elastic jobs shrink (a scaling policy) before anyone is preempted
            shrinks = self.elasticity.shrink_for(job, walk.pending[job.pool], now)
            if self._waits_for_shrinks(rec, shrinks, walk):
                return
        rec.waiting_for_shrink = ()
        if assignment is None and cls == QuotaClass.GUARANTEED and self.ledger.config:
            # borrowing elastic jobs shrink first; whole gangs are preempted only if
            # that cannot make room
            if self._waits_for_shrinks(rec, self.elasticity.shrink_borrowers(job, now), walk):
                return
            assignment, victims = self._place_by_preemption(job, now)
            if victims:
                walk.failed_shapes.clear()
        if assignment is None:
            walk.failed_shapes.add(shape)
            if cls == QuotaClass.BORROW:
                walk.borrowers_blocked.setdefault(job.pool, job.job_id)
            else:
                walk.blocked.setdefault(job.pool, job.job_id)
            rec.blocked_by = None
            return
        for victim in victims:
            self._requeue_preempted(victim, now)
            walk.preempted.append(victim)
            walk.preempted_for[victim] = job
        walk.placements.append(self._commit(rec, assignment, cls == QuotaClass.BORROW, now))

    def _waits_for_shrinks(
        self, rec: JobRecord, shrinks: tuple[bool, dict[str, tuple[int, str]]], walk: _Pass
    ) -> bool:
        """Take the shrinks an elastic driver asked for to make room for ``rec``'s job; when
        the job waits for them (True), it holds its pool until they are done."""
        waits, asked = shrinks
        walk.resize.update(asked)
        if waits:
            rec.waiting_for_shrink = tuple(self.elasticity.waiting_on(rec.job.pool))
            walk.blocked.setdefault(rec.job.pool, rec.job.job_id)
            rec.blocked_by = None
        return waits

    def _commit(
        self, rec: JobRecord, assignment: Assignment, borrowing: bool, now: float
    ) -> Placement:
        job = rec.job
        self.cluster.allocate(job, assignment.learner_nodes)
        self.ledger.charge(job, borrowing)
        self.queue.remove(job.job_id)
        names = tuple(self.cluster.nodes[i].name for i in assignment.learner_nodes)
        rec.placement = Placement(job.job_id, names, now, self.policy.name, borrowing)
        self._placed[job.job_id] = rec
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
        self._placed.pop(job_id, None)
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
        self._placed.pop(job_id, None)
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
        return [r.placement for r in self._placed.values() if r.placement is not None]

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
                    self._placed[job.job_id] = rec
                    banked_at = doc.get("banked_at")
                    rec.banked_at = float(banked_at) if banked_at is not None else None
                    if state == SchedState.RESERVED:
                        self.restored_reservations.append(job.job_id)
                    continue
            self.queue.push(job, seq=rec.seq, batch=rec.batch, attained_gpu_s=rec.attained_gpu_s)
            if state != SchedState.QUEUED:
                self._save(rec)
