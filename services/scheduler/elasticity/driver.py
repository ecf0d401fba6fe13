"""The GangScheduler's side of a scaling policy: which placed jobs are elastic and how
big they are, the shrinks asked for and not yet done, and the checks of every proposal
against the cluster model.

An elastic job holds its own gang (the record under its id) and the gangs its
scale-outs added (``<job>+scale-<n>``, services/scheduler/api.py). Its size is their sum.

A shrink is a request, not a release: the scheduler keeps the job's resources until the
job really runs on fewer learners (the guardian retired them and the record says so;
``GangScheduler.resize``), so nothing is double-booked while learners leave. The waiting
job stays at the head of its queue meanwhile ("waiting for ... to shrink"). A shrink
that is not done within ``SHRINK_TIMEOUT_S`` (refused: the job was not PROCESSING any
more) is forgotten, and the policy may ask again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from services.scheduler.api import JobRequest, scale_gang_parent
from services.scheduler.elasticity.api import ElasticJob, ScalingPolicy, StaticScaling

if TYPE_CHECKING:
    from services.scheduler.scheduler import GangScheduler, JobRecord

# a resize asked for and not applied by then (refused, or its job ended) is forgotten
SHRINK_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class PendingResize:
    learners: int
    asked_at: float
    reason: str


class ElasticDriver:
    def __init__(self, scheduler: GangScheduler, policy: ScalingPolicy | None) -> None:
        self.s = scheduler
        self.policy = policy or StaticScaling()
        self.bounds: dict[str, tuple[int, int]] = {}  # job id -> (min, max) learners
        self.shrinking: dict[str, PendingResize] = {}
        self.growing: dict[str, PendingResize] = {}  # growths asked for, not yet applied
        # job id -> when its last checkpoint was committed (the guardian reports it)
        self.checkpoints: dict[str, float] = {}

    @property
    def active(self) -> bool:
        return not isinstance(self.policy, StaticScaling)

    # -- what the service tells it ---------------------------------------------------------
    def set_bounds(self, job_id: str, lo: int, hi: int) -> None:
        self.bounds[job_id] = (lo, hi)

    def forget(self, job_id: str) -> None:
        self.checkpoints.pop(job_id, None)
        self.bounds.pop(job_id, None)
        self.shrinking.pop(job_id, None)
        self.growing.pop(job_id, None)

    def grown(self, job_id: str) -> None:
        """A growth was applied or given up (its gang placed and deployed, or refused)."""
        self.growing.pop(job_id, None)

    def records_of(self, job_id: str) -> list[JobRecord]:
        """The job's own record, then its scale gangs, oldest first."""
        own = self.s.records.get(job_id)
        gangs = [
            r
            for gid, r in self.s.records.items()
            if scale_gang_parent(gid) == job_id and r.placement is not None
        ]
        return ([own] if own is not None and own.placement is not None else []) + gangs

    def size(self, job_id: str) -> int:
        return sum(r.job.learners for r in self.records_of(job_id))

    def resize(self, job_id: str, learners: int) -> bool:
        """The job runs on ``learners`` now: shrink what it holds to that (the newest scale
        gang first, then its own gang, keeping the lowest ranks: a scale-in retires the
        highest). Growth arrives as scale gangs, never here. True if something was freed."""
        pending = self.shrinking.get(job_id)
        if pending is not None and learners <= pending.learners:
            del self.shrinking[job_id]
        excess = self.size(job_id) - max(learners, 1)
        freed = False
        for rec in reversed(self.records_of(job_id)):
            if excess <= 0:
                break
            keep = max(rec.job.learners - excess, 0)
            excess -= rec.job.learners - keep
            freed = True
            if keep == 0:
                self.s.release(rec.job.job_id)
            else:
                self.s.shrink_record(rec, keep)
        return freed

    # -- preemption that loses the least work ----------------------------------------------
    def lost_work(self, rec: JobRecord, now: float) -> float:
        """GPU-seconds (learner-seconds for CPU jobs) a record's learners would lose if
        stopped now: the time since its job's last checkpoint, or since it was placed."""
        assert rec.placement is not None
        owner = scale_gang_parent(rec.job.job_id) or rec.job.job_id
        since = max(self.checkpoints.get(owner, 0.0), rec.placement.placed_at)
        return max(0.0, now - since) * rec.job.learners * max(1, rec.job.gpus)

    def shrink_borrowers(
        self, job: JobRequest, now: float
    ) -> tuple[bool, dict[str, tuple[int, str]]]:
        """Quota reclaim, shrink first: elastic jobs that borrow GPUs of ``job``'s type
        shrink towards their minimum (lowest priority, then the most recently placed,
        first), as few as make room; a shrink loses no work, a preemption does. Returns
        (whether ``job`` waits for shrinks, the new shrinks to ask for)."""
        if self.shrinking and self.fits_if(job, {}):
            return True, {}
        candidates = []
        for job_id, (lo, _) in self.bounds.items():
            recs = self.records_of(job_id)
            if (
                recs
                and job_id not in self.shrinking
                and recs[0].job.pool == job.pool
                and any(r.placement is not None and r.placement.borrowing for r in recs)
                and self.size(job_id) > lo
            ):
                candidates.append(recs[0])
        candidates.sort(
            key=lambda r: (r.job.priority, -(r.placement.placed_at if r.placement else 0.0))
        )
        sizes: dict[str, int] = {}
        for rec in candidates:
            job_id = rec.job.job_id
            fits = False
            # one learner at a time, towards the minimum: as little as makes room
            for learners in range(self.size(job_id) - 1, self.bounds[job_id][0] - 1, -1):
                sizes[job_id] = learners
                fits = self.fits_if(job, sizes)
                if fits:
                    break
            if fits:
                asked = {}
                for job_id, learners in sizes.items():
                    reason = (
                        f"quota reclaim: {job.owner or 'another user'}'s guaranteed job "
                        f"{job.job_id} needs the GPUs it borrows; shrinks instead of a preemption"
                    )
                    self.shrinking[job_id] = PendingResize(learners, now, reason)
                    asked[job_id] = (learners, reason)
                return True, asked
        return False, {}

    # -- decisions -------------------------------------------------------------------------
    def elastic_jobs(self, pool: str, now: float) -> list[ElasticJob]:
        out = []
        for job_id, (lo, hi) in self.bounds.items():
            rec = self.s.records.get(job_id)
            if rec is None or rec.placement is None or rec.job.pool != pool:
                continue
            size = self.size(job_id)
            if job_id in self.shrinking:
                size = min(size, self.shrinking[job_id].learners)
            out.append(
                ElasticJob(
                    job_id,
                    size,
                    lo,
                    hi,
                    rec.job.gpus,
                    # the number the queue's Tiresias order uses (GangScheduler.attained)
                    attained_gpu_s=self.s.attained(job_id, now),
                    arrival=rec.job.arrival,
                    pool=pool,
                )
            )
        return out

    def expire(self, now: float) -> None:
        for asked in (self.shrinking, self.growing):
            for job_id, pending in list(asked.items()):
                if now - pending.asked_at > SHRINK_TIMEOUT_S:
                    del asked[job_id]

    def waiting_on(self, pool: str) -> list[str]:
        return [
            j for j in self.shrinking if j in self.s.records and self.s.records[j].job.pool == pool
        ]

    def fits_if(self, job: JobRequest, sizes: Mapping[str, int]) -> bool:
        """Would ``job`` be placed if the running jobs had ``sizes`` (and the shrinks
        already asked for were done)? Tried on the cluster model and undone."""
        all_sizes = {j: p.learners for j, p in self.shrinking.items()}
        all_sizes.update(sizes)
        cluster = self.s.cluster
        saved: list[tuple[str, JobRequest, tuple[int, ...]]] = []
        try:
            for job_id, learners in all_sizes.items():
                excess = self.size(job_id) - learners
                for rec in reversed(self.records_of(job_id)):
                    if excess <= 0:
                        break
                    alloc = cluster.release(rec.job.job_id)
                    if alloc is None:
                        continue
                    saved.append((rec.job.job_id, alloc.job, alloc.learner_nodes))
                    keep = max(rec.job.learners - excess, 0)
                    excess -= rec.job.learners - keep
                    if keep:
                        cluster.allocate(
                            replace(alloc.job, learners=keep), alloc.learner_nodes[:keep]
                        )
            return self.s._propose(job) is not None
        finally:
            for gid, _, _ in saved:
                cluster.release(gid)
            for _, req, nodes in saved:
                cluster.allocate(req, nodes)

    def shrink_for(
        self, job: JobRequest, pending: int, now: float
    ) -> tuple[bool, dict[str, tuple[int, str]]]:
        """A queued ``job`` does not fit. Returns (whether it waits for shrinks, the new
        shrinks to ask for)."""
        if not self.active or scale_gang_parent(job.job_id) is not None:
            return False, {}
        if self.shrinking and self.fits_if(job, {}):
            return True, {}  # the shrinks asked for already make room: wait for them
        jobs = self.elastic_jobs(job.pool, now)
        decisions = self.policy.shrink(job.learners, pending, jobs, lambda s: self.fits_if(job, s))
        asked: dict[str, tuple[int, str]] = {}
        for d in decisions:
            lo, _ = self.bounds[d.job_id]
            current = next(j.learners for j in jobs if j.job_id == d.job_id)
            if not lo <= d.learners < current:  # a policy may only shrink, within bounds
                continue
            self.shrinking[d.job_id] = PendingResize(d.learners, now, d.reason)
            asked[d.job_id] = (d.learners, d.reason)
        return bool(asked), asked

    def grow(self, pools: set[str], now: float) -> dict[str, tuple[int, str]]:
        """Grow elastic jobs of ``pools`` (where nobody waits) into idle capacity; the
        added learners are reserved by the caller as scale gangs."""
        if not self.active:
            return {}
        out: dict[str, tuple[int, str]] = {}
        held: list[str] = []
        try:
            for pool in sorted(pools):
                jobs = [
                    j
                    for j in self.elastic_jobs(pool, now)
                    if j.job_id not in self.shrinking and j.job_id not in self.growing
                ]
                if not jobs:
                    continue

                def take(job_id: str) -> bool:
                    one = replace(
                        self.s.records[job_id].job,
                        job_id=f"{job_id}#grow-{len(held)}",
                        learners=1,
                        max_nodes=None,
                        zone_aware=False,
                    )
                    assignment = self.s._propose(one)
                    if assignment is None:
                        return False
                    self.s.cluster.allocate(one, assignment.learner_nodes)
                    held.append(one.job_id)
                    return True

                for d in self.policy.grow(jobs, take):
                    _, hi = self.bounds[d.job_id]
                    current = next(j.learners for j in jobs if j.job_id == d.job_id)
                    if not current < d.learners <= hi:  # a policy may only grow, within bounds
                        continue
                    self.growing[d.job_id] = PendingResize(d.learners, now, d.reason)
                    out[d.job_id] = (d.learners, d.reason)
        finally:
            for gid in held:  # the real gangs are placed by the scheduler, as any gang
                self.s.cluster.release(gid)
        return out
