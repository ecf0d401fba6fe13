"""How the daemon hosts the scheduler: the `rhizome.v1.Scheduler` service plus the
scheduling loop that connects the gang scheduler to the jobs in MongoDB.

Jobs arrive pushed: the API of this daemon hands each job it stores to `LocalScheduler`
(a plain call: no proto), which the next pass queues; an API elsewhere calls `Admit`,
which queues it at once. Either wakes the loop. Each pass of the loop (at once when
woken, else five times a second):
0. the jobs handed over since the last pass are queued (one whose request the cluster can
   no longer hold fails with the reason);
1. every few seconds, a resync with the QUEUED records catches jobs whose hand-over was
   lost (a job that can never fit any more fails with the reason instead of waiting
   forever): the ids newer than the newest it queued, and at the first pass and every
   minute every QUEUED id, which also drops queue entries whose job left the queue (the
   release check below drops them within half a second);
2. one scheduling pass places whole gangs; each placed job moves QUEUED → PENDING with
   its placement (the LCM takes it from there). A placement the scheduler restored after
   a restart, whose job is still QUEUED, is written the same way, so a crash between the
   two writes neither loses nor double-books;
3. jobs whose borrowed quota is reclaimed are halted (not lost);
4. every two seconds, the explanations of the jobs at the head of the queue are written
   to their records (`rhizome show` prints them);
5. the placements of jobs that no longer hold resources are released, and queued jobs
   whose record left QUEUED (deleted, halted) leave the queue: every half second
   from the records written since the last look (`JobsRepository.written_since`, a range
   read on the sparse `touched_at` index, which a record enters at its first write after
   its creation), every 30 s and at the first pass from every placed job's record (the
   safety net behind the look-back);
6. with a scaling policy (the cluster config's `scheduler.scaling`, e.g. Elastic-Tiresias;
   services/scheduler/elasticity), the resizes it proposes become scale requests to the
   jobs' guardians (through the LCM, as `rhizome scale`): a shrink frees its resources
   once the job's record runs on fewer learners, a growth is a scale gang placed here
   first (docs/elastic.md, "The scheduler scales elastic jobs").
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import grpc
from rhizome.v1 import lcm_pb2, lcm_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

from services.hosting import DaemonContext, Hosted, jobs_repository, unanswered
from services.scheduler.api import (
    ClusterConfigError,
    JobRequest,
    PlacementStore,
    SchedState,
    SchedulerError,
    scale_gang_id,
    scale_gang_parent,
)
from services.scheduler.cluster import Cluster
from services.scheduler.elasticity import load_scaling_config
from services.scheduler.persist import MongoPlacementStore
from services.scheduler.quota import load_quota_config
from services.scheduler.requests import job_request
from services.scheduler.scheduler import GangScheduler
from services.scheduler.servicer import SchedulerServicer, placement_to_proto
from services.scheduler.source import ClusterSource, ConfigFileSource, cluster_source
from services.store import states
from services.store.errors import JobNotFound
from services.store.jobs import JobRecord, JobsRepository
from services.store.mongo import database_name

log = logging.getLogger("rhizome.scheduler")

PASS_INTERVAL_S = 0.2
# Explanations are for people reading `rhizome show`: refreshed every second for the
# jobs at the head of the queue, not rewritten for every queued job on every pass.
EXPLAIN_INTERVAL_S = 2.0
EXPLAIN_AT_MOST = 10
# Freeing the placements of ended jobs and rescanning the whole queue are not urgent.
RELEASE_INTERVAL_S = 0.5
RESYNC_INTERVAL_S = 5.0
# The resync's read of every QUEUED id costs the MongoDB-wire server ~40 us an id, and
# every insert waits behind it: with 4,000 queued, 150 ms of its CPU every 5 s, the
# REST submits' p99 at 16 clients in benchmarks/api_submit.py (issue #18). So every
# RESYNC_INTERVAL_S only the ids newer than the newest job queued are read (the stored
# jobs whose hand-over is still on its way, or lost); the whole read, at the first pass
# and this often, catches the rest (a lost hand-over of a resumed job, whose id is old;
# a job stored by a daemon whose clock is behind).
FULL_RESYNC_INTERVAL_S = 60.0
# The release check reads only the placed jobs' records written since its last read (a
# whole record of every placed job, twice a second, was the daemon's largest steady cost
# per alive job: issue #18). How far before that read it asks: a write stamps its
# `updated_at` before it lands (and another machine's clock may be behind ours); one that
# lands later than this is seen by the next full read.
RELEASE_LOOKBACK_S = 5.0
# How often (and at the first check) the release check reads every placed job's record:
# the safety net for a write the change read missed.
FULL_RELEASE_READ_S = 30.0
# Passes woken back to back (a burst of submits) are spaced by at least this much.
MIN_PASS_GAP_S = 0.05
# Stored jobs handed over and not queued yet, at most (a daemon whose loop does not run,
# a hot standby, holds no more): one left out is stored, and the resync queues it.
ARRIVALS_HELD = 100_000


class SchedulingLoop:
    def __init__(
        self,
        scheduler: GangScheduler,
        servicer: SchedulerServicer,
        jobs: JobsRepository,
        lcm_channel: grpc.Channel | None,
        source: ClusterSource | None = None,
        scale: Callable[[str, int, str], str] | None = None,
    ) -> None:
        self.scheduler = scheduler
        # How a resize reaches a job's guardian: (job, learners, reason) -> the answer;
        # raises on a refusal. The LCM's ScaleJob unless given (tests call request_scale).
        self.scale = scale if scale is not None else self._scale_through_lcm
        self._stragglers_seen: set[tuple[str, str]] = set()  # (job, worker) passed on
        self._bounds: dict[str, tuple[int, int] | None] = {}  # job -> elastic (min, max)
        self.source = source
        self._nodes_version = -1  # the first pass takes the source's nodes as they are then
        self.lock = servicer._lock  # the servicer and the loop share one scheduler
        self.jobs = jobs
        self.lcm = lcm_pb2_grpc.LifecycleManagerStub(lcm_channel) if lcm_channel else None
        self.stop_event = threading.Event()
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name="scheduling-loop", daemon=True)
        self._reasons: dict[str, str] = {}
        self._passes = 0
        self._pass_done = threading.Condition()
        self._last_placed: list[scheduler_pb2.JobPlacement] = []
        self._bound: set[str] = set()  # placed jobs whose record says so
        # Scale gangs placed and still held: Schedule answers them (the pass that placed
        # one may be the pass its Admit woke, before the API's Schedule call).
        self.gangs: dict[str, scheduler_pb2.JobPlacement] = {}
        self._explained_at = 0.0
        self._released_at = 0.0
        self._synced_at = 0.0
        # when the last resync that read every QUEUED id was (monotonic; -inf: the next is
        # one), and the newest job id queued (ids sort by creation: those after it are new)
        self.full_resync_interval_s = FULL_RESYNC_INTERVAL_S
        self._full_synced_at = float("-inf")
        self._newest_queued = ""
        # the `updated_at` of each queued job's record the release check read last (a
        # record the change read's look-back returns again unchanged is not read again)
        self._queued_stamps: dict[str, float] = {}
        # The release check's reads (`_release_finished`): when the last full one was
        # (monotonic; -inf: the next is one), from when the next change read asks
        # (wall clock: `updated_at` is), the `updated_at` of each placed job's record as
        # last read (a record the look-back returns again unchanged is not read again),
        # and the jobs placed at the last read (one placed since is read whatever its stamp).
        self.full_release_read_s = FULL_RELEASE_READ_S
        self.release_lookback_s = RELEASE_LOOKBACK_S
        self._full_read_at = float("-inf")
        self._read_since = 0.0
        self._read_stamps: dict[str, float] = {}
        self._placed_at_read: set[str] = set()
        # Stored jobs handed over by the API of this daemon (`arrive`), queued by the next
        # pass: the submit that hands one over never waits for the scheduler's lock.
        self._arrivals: collections.deque[JobRecord] = collections.deque(maxlen=ARRIVALS_HELD)

    def arrive(self, job: JobRecord) -> None:
        """A stored job to queue: at the next pass, which this wakes."""
        self._arrivals.append(job)
        self.wake.set()

    def _queue_arrivals(self) -> None:
        """Queue the jobs handed over since the last pass, in the order they came, each
        arriving now (as `Admit` stamps a job it queues)."""
        handed: list[JobRecord] = []
        while self._arrivals:
            handed.append(self._arrivals.popleft())
        self._queue(handed, arriving_now=True)

    def _queue(self, jobs: Iterable[JobRecord], arriving_now: bool = False) -> None:
        """Queue stored jobs (arriving when they were created, unless `arriving_now`). One
        the scheduler refuses (the cluster model changed since its submit was admitted, a
        resumed job that can no longer fit) fails with the reason."""
        refused: list[tuple[str, str]] = []
        with self.lock:
            for job in jobs:
                arrival = time.time() if arriving_now else None
                try:
                    self.scheduler.enqueue(
                        job_request(job, arrival=arrival), attained_gpu_s=job.attained_gpu_s
                    )
                except SchedulerError as exc:
                    refused.append((job.job_id, str(exc)))
                    continue
                self._newest_queued = max(self._newest_queued, job.job_id)
        for job_id, reason in refused:
            self._fail(job_id, f"cannot be scheduled: {reason}")

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.wake.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        while not self.stop_event.is_set():
            self.wake.clear()
            try:
                self.run_pass()
            except Exception:  # the loop must outlive a bad pass (store hiccup, etc.)
                log.exception("scheduling pass failed; retrying")
            with self._pass_done:
                self._passes += 1
                self._pass_done.notify_all()
            self.stop_event.wait(MIN_PASS_GAP_S)
            self.wake.wait(PASS_INTERVAL_S - MIN_PASS_GAP_S)

    def pass_now(self, timeout_s: float = 5.0) -> list[scheduler_pb2.JobPlacement]:
        """Run a pass that starts after this call (coalesced with others) and return what
        it placed: the Schedule RPC."""
        with self._pass_done:
            target = self._passes + 2  # the pass running now may have missed the request
            self.wake.set()
            self._pass_done.wait_for(lambda: self._passes >= target, timeout_s)
            return list(self._last_placed)

    def run_pass(self) -> None:
        now = time.monotonic()
        self._follow_nodes()
        if self._arrivals:
            self._queue_arrivals()
        if now - self._synced_at >= RESYNC_INTERVAL_S:
            self._synced_at = now
            self._resync(full=now - self._full_synced_at >= self.full_resync_interval_s)
        with self.lock:
            shrinking = list(self.scheduler.elasticity.shrinking)
        if shrinking:  # free what a shrink retired as soon as the record says so
            self._follow_records(self.jobs.get_many(shrinking))
        with self.lock:
            result = self.scheduler.schedule()
            placements = self.scheduler.placements()
        placed: list[scheduler_pb2.JobPlacement] = []
        for placement in placements:
            if placement.job_id in self._bound:
                continue
            # A running job's scale gang has no record to move: the API that asked for it
            # takes its placement from this pass's answer and writes it to the job's.
            gang = scale_gang_parent(placement.job_id) is not None
            if gang:
                self._bound.add(placement.job_id)
                self.gangs[placement.job_id] = scheduler_pb2.JobPlacement(
                    job_id=placement.job_id, placement=placement_to_proto(placement)
                )
            if gang or self._bind(
                placement.job_id, list(placement.learner_nodes), placement.placed_at
            ):
                placed.append(
                    scheduler_pb2.JobPlacement(
                        job_id=placement.job_id, placement=placement_to_proto(placement)
                    )
                )
        self._last_placed = placed
        held = {p.job_id for p in placements}
        for job_id in [g for g in self.gangs if g not in held]:  # released by the API
            self.gangs.pop(job_id, None)
            self._bound.discard(job_id)
        for job_id in result.preempted:
            self._bound.discard(job_id)
            self._halt(job_id, result.preempted_for.get(job_id))
        for job_id, (learners, reason) in result.resize.items():
            self._resize(job_id, learners, reason)
        if now - self._explained_at >= EXPLAIN_INTERVAL_S:
            self._explained_at = now
            with self.lock:  # the head only: a pass must not cost a walk of the queue
                head = [e.job.job_id for e in self.scheduler.queue.head(EXPLAIN_AT_MOST)]
            self._explain(head)
        if now - self._released_at >= RELEASE_INTERVAL_S:
            self._released_at = now
            self._release_finished([p.job_id for p in placements])

    # -- a scaling policy's resizes (services/scheduler/elasticity) -------------------------
    def _follow_records(self, records: Iterable[JobRecord]) -> None:
        """From placed jobs' records, tell the scheduler which are elastic (their
        manifest's bounds), how many learners each runs on now (the record's size, which
        the guardian changes when it applies a scale: a job that shrank frees the rest),
        and when each last saved a checkpoint (the record's `last_checkpoint`, the newest
        its learners reported through contract/checkpoints.py: a preemption takes the job
        that loses the least work). Fed by the
        release check's reads (a record is read when it was written since the last read, a
        job when it was placed since, every placed job every `full_release_read_s`), so it
        costs no read of its own: a size, a straggler, a scale gang or a checkpoint reaches
        the record by a write that moves its `updated_at`."""
        for job in records:
            if job.status not in states.ACTIVE_STATES:
                continue
            saved = job.last_checkpoint or {}
            if job.job_id not in self._bounds:  # the typed manifest, parsed once per job
                el = job.spec.elastic
                self._bounds[job.job_id] = (el.min, el.max) if el is not None else None
            bounds = self._bounds[job.job_id]
            learners = int(job.resources["learners"])
            with self.lock:
                # a node that slowed a learner down is avoided whatever placed the job
                for straggler in (job.placement or {}).get("stragglers") or []:
                    seen = (job.job_id, str(straggler.get("worker")))
                    if seen not in self._stragglers_seen:
                        self._stragglers_seen.add(seen)
                        self.scheduler.avoid_node(str(straggler.get("node")))
                        log.info(
                            "avoiding node %s for a while: a straggler of job %s",
                            straggler.get("node"),
                            job.job_id,
                        )
                if job.job_id not in self.scheduler.records:
                    continue
                if saved.get("at") is not None:
                    self.scheduler.note_checkpoint(job.job_id, float(saved["at"]))
                if bounds is None:
                    continue
                self.scheduler.set_elastic(job.job_id, *bounds)
                # a scale-out in flight holds its gang before the record counts its learners
                adding = sum(
                    int((g or {}).get("learners") or 0)
                    for g in ((job.placement or {}).get("scale_gangs") or {}).values()
                    if (g or {}).get("state") == "requested"
                )
                if learners + adding < self.scheduler.job_size(job.job_id):
                    self.scheduler.resize(job.job_id, learners)
                    log.info("job %s runs on %d learners: freed the rest", job.job_id, learners)
                    self.wake.set()  # a waiting job may fit now

    def _resize(self, job_id: str, learners: int, reason: str) -> None:
        with self.lock:
            current = self.scheduler.job_size(job_id)
        gang = ""
        try:
            if learners > current:
                gang = self._place_growth(job_id, learners - current, learners)
            answer = self.scale(job_id, learners, reason)
            log.info("job %s: %s (%s)", job_id, answer, reason)
        except Exception as exc:  # a refusal (not PROCESSING any more), an LCM away
            log.info("job %s: resize to %d not asked: %s", job_id, learners, exc)
            with self.lock:
                self.scheduler.elasticity.shrinking.pop(job_id, None)
                self.scheduler.elasticity.grown(job_id)
                if gang:
                    self.scheduler.release(gang)
            if gang:
                with contextlib.suppress(JobNotFound):
                    self.jobs.update_fields(job_id, **{f"placement.scale_gangs.{gang}": None})
            return
        if gang:
            with self.lock:
                self.scheduler.elasticity.grown(job_id)

    def _place_growth(self, job_id: str, added: int, target: int) -> str:
        """The learners a growth adds, as a scale gang like a user's scale-out (listed in
        the record first, then placed, then its nodes written; the guardian deploys onto
        them). Raises SchedulerError when it does not fit any more."""
        job = self.jobs.get(job_id)
        gang = scale_gang_id(job_id, job.version)
        field = f"placement.scale_gangs.{gang}"
        entry: dict[str, Any] = {"learners": added, "target": target, "state": "requested",
                                 "nodes": []}  # fmt: skip
        self.jobs.update_fields(job_id, **{field: entry})
        with self.lock:
            own = self.scheduler.records[job_id].job
            placement = self.scheduler.place_now(
                replace(own, job_id=gang, learners=added, max_nodes=None, zone_aware=False)
            )
        self._bound.add(gang)
        self.gangs[gang] = scheduler_pb2.JobPlacement(
            job_id=gang, placement=placement_to_proto(placement)
        )
        self.jobs.update_fields(
            job_id, **{field: {**entry, "nodes": list(placement.learner_nodes)}}
        )
        return gang

    def _scale_through_lcm(self, job_id: str, learners: int, reason: str) -> str:
        if self.lcm is None:
            raise SchedulerError("no lifecycle manager to ask")
        try:
            resp = self.lcm.ScaleJob(
                lcm_pb2.LcmScaleRequest(job_id=job_id, learners=learners, reason=reason),
                timeout=10,
            )
        except grpc.RpcError as exc:
            raise SchedulerError(str(exc.details())) from None
        if not resp.accepted:
            raise SchedulerError(resp.message or "refused")
        return str(resp.message)

    def _follow_nodes(self) -> None:
        """Rebuild the model when the cluster source's nodes changed (Kubernetes: a node
        added, removed, cordoned, NotReady), so admission, the queue's reasons and
        placement see the nodes the pods are bound to."""
        if self.source is None or self.source.version() == self._nodes_version:
            return
        version = self.source.version()
        nodes = self.source.nodes()
        with self.lock:
            try:
                gone = self.scheduler.replace_nodes(nodes)
            except ClusterConfigError as exc:
                # No schedulable node at all (every one cordoned or NotReady): keep the
                # last model, so queued jobs wait rather than fail as "never fits".
                log.warning(
                    "%s: %s; keeping the last %d nodes",
                    self.source.describe(),
                    exc,
                    len(self.scheduler.cluster.nodes),
                )
                self._nodes_version = version
                return
        self._nodes_version = version
        log.info("%s: %d schedulable nodes", self.source.describe(), len(nodes))
        for job_id in gone:
            log.info("job %s: its nodes left the cluster model", job_id)

    def _resync(self, full: bool) -> None:
        """Bring the scheduler's queue in line with the QUEUED records: jobs whose hand-over
        never arrived (a crash in between, a push to another daemon that failed) join it;
        with `full`, every QUEUED id is read and queued entries whose job left the queue
        (deleted, halted) leave it, else only the ids after the newest queued
        (FULL_RESYNC_INTERVAL_S: why). The API hands each new job over as it is stored,
        so this is a safety net, not the way jobs arrive."""
        started = time.monotonic()
        queued_ids = self.jobs.ids_by_status(
            [states.QUEUED], after="" if full else self._newest_queued
        )
        with self.lock:
            known = set(self.scheduler.records)
            stale = (
                {
                    job_id
                    for job_id in set(self.scheduler.queued()) - set(queued_ids)
                    if scale_gang_parent(job_id) is None  # placed or released by the API
                }
                if full
                else set()
            )
        for job_id in stale:
            self._release(job_id)
        joining = self.jobs.get_many([i for i in queued_ids if i not in known])
        self._queue(job for job in joining if job.status == states.QUEUED)
        if full:
            self._full_synced_at = started

    def _bind(self, job_id: str, nodes: list[str], placed_at: float) -> bool:
        """QUEUED -> PENDING with the placement. False when the record had moved on
        already (placed before a restart, deleted, halted)."""
        placement = {
            "learner_nodes": {str(r): n for r, n in enumerate(nodes)},
            "placed_at": placed_at,
        }
        where = ", ".join(sorted(set(nodes)))
        self._bound.add(job_id)
        self._reasons.pop(job_id, None)
        try:
            self.jobs.transition(
                job_id, states.PENDING, f"placed on {where}", placement=placement, queue_reason=""
            )
        except (states.IllegalTransition, JobNotFound):
            return False  # the release check frees it if the job no longer runs
        if self.lcm is not None:
            # Wake the LCM now rather than at its next poll; its answer does not matter.
            unanswered(self.lcm.DeployJob.future(lcm_pb2.LcmJobRequest(job_id=job_id), timeout=5))
        return True

    def _fail(self, job_id: str, reason: str) -> None:
        with contextlib.suppress(states.IllegalTransition, JobNotFound):
            self.jobs.transition(job_id, states.FAILED, reason)

    def _halt(self, job_id: str, made_room_for: JobRequest | None = None) -> None:
        reason = "halted: the owner of the quota it borrowed needs it back; resume it later"
        if made_room_for is not None:
            reason = (
                f"halted by the scheduler: {made_room_for.owner or 'the owner'} of the quota it "
                f"borrowed needs it back for job {made_room_for.job_id} (of the borrowers, "
                "the lowest priority that loses the least work since its last checkpoint); "
                "resume it later"
            )
        # The library queues a preempted job again; here it is halted (the user resumes
        # it), so it leaves the scheduler until it is queued again.
        self._release(job_id)
        job = self.jobs.get(job_id)
        if job.status in (states.QUEUED, states.PENDING) or self.lcm is None:
            try:
                self.jobs.transition(job_id, states.HALTED, reason)
            except states.IllegalTransition:
                log.warning("could not halt preempted job %s (%s)", job_id, job.status)
            return
        try:
            self.lcm.HaltJob(lcm_pb2.LcmJobRequest(job_id=job_id, reason=reason), timeout=10)
        except grpc.RpcError as exc:
            log.warning("could not halt preempted job %s: %s", job_id, exc.details())

    def _explain(self, waiting: list[str]) -> None:
        """Keep the head of the queue's explanations current (rhizome show prints them)."""
        for job_id in waiting:
            with self.lock:
                if job_id not in self.scheduler.records:
                    continue
                reason = self.scheduler.explain(job_id)
            if reason != self._reasons.get(job_id):
                with contextlib.suppress(JobNotFound):
                    self.jobs.update_fields(job_id, queue_reason=reason)
                self._reasons[job_id] = reason

    def _release(self, job_id: str) -> None:
        """Release a job (or a scale gang) from the scheduler. A job's attained service is
        written to its record, so that a resume after a restart of this daemon keeps its
        place in the Tiresias order (the scheduler remembers it only in memory)."""
        with self.lock:
            known = self.scheduler.release(job_id)
            attained = self.scheduler.attained(job_id) if known else 0.0
        if attained > 0 and scale_gang_parent(job_id) is None:
            with contextlib.suppress(JobNotFound):
                self.jobs.set_attained(job_id, attained)

    def _release_finished(self, placed: list[str]) -> None:
        """Free the placements of jobs that no longer hold resources (ended, halted), and
        the scale gangs their elastic job no longer lists (retired, rolled back).

        Reads the records of the placed jobs written since the last check (and of those
        placed since), not every placed job's: a quiet check reads no record. Every
        `full_release_read_s`, and at the first check, it reads every placed job's record
        (a write that landed later than the look-back, a record removed outright)."""
        parents = {job_id: scale_gang_parent(job_id) for job_id in placed}
        record_of = {job_id: parents[job_id] or job_id for job_id in placed}
        wanted = set(record_of.values())  # a scale gang has no record: its job's
        started, now = time.time(), time.monotonic()
        full = now - self._full_read_at >= self.full_release_read_s
        if full:
            read = wanted
        else:
            written = self.jobs.written_since(self._read_since - self.release_lookback_s)
            self._drop_leavers(written)
            read = {record_of[j] for j in placed if j not in self._placed_at_read}
            read.update(
                job_id
                for job_id in wanted
                if job_id in written and written[job_id] != self._read_stamps.get(job_id)
            )
        records = {j.job_id: j for j in self.jobs.get_many(read)} if read else {}
        # (only once the reads succeeded: a failed one is made again by the next check)
        if full:
            self._full_read_at = now
        self._read_since = started
        self._placed_at_read = set(placed)
        self._read_stamps = {
            job_id: records[job_id].updated_at if job_id in records else self._read_stamps[job_id]
            for job_id in wanted
            if job_id in records or (job_id in self._read_stamps and job_id not in read)
        }
        self._follow_records(records.values())
        for job_id in placed:
            if record_of[job_id] not in read:
                continue  # its record was not written since it was last read
            parent = parents[job_id]
            job = records.get(record_of[job_id])
            gone = job is None or job.status not in states.ACTIVE_STATES
            if parent is not None and job is not None:
                gone = gone or not ((job.placement or {}).get("scale_gangs") or {}).get(job_id)
            if gone:
                self._release(job_id)
                self._bound.discard(job_id)
                self.gangs.pop(job_id, None)
                self._bounds.pop(job_id, None)
                log.info("released the placement of %s", job_id)

    def _drop_leavers(self, written: Mapping[str, float]) -> None:
        """Queued jobs whose record was written since the last look (a job leaves the
        queue by a write: deleted, halted) and whose record says it is no longer QUEUED
        leave the scheduler's queue (the full resync is the safety net behind this)."""
        with self.lock:
            records = self.scheduler.records
            changed = [
                job_id
                for job_id, stamp in written.items()
                if job_id in records
                and records[job_id].state == SchedState.QUEUED
                and stamp != self._queued_stamps.get(job_id)
            ]
        # a stamp outside this look-back will not come back
        self._queued_stamps = {j: t for j, t in self._queued_stamps.items() if j in written}
        if not changed:
            return
        found = {job.job_id: job for job in self.jobs.get_many(changed)}
        for job_id in changed:
            job = found.get(job_id)
            if job is not None:
                self._queued_stamps[job_id] = job.updated_at
            if job is None or job.status != states.QUEUED:
                self._release(job_id)
                self._queued_stamps.pop(job_id, None)
                log.info("job %s left the queue", job_id)


class PlacementsOnlyStore(PlacementStore):
    """In the daemon the queue's source of truth is the jobs collection (QUEUED records,
    ordered by their time-ordered ids), so only placements are persisted: one write per
    placed job rather than one per submitted job, which the submit path would pay for."""

    def __init__(self, inner: PlacementStore) -> None:
        self.inner = inner
        self.stored: set[str] = set()

    def save(self, doc: Mapping[str, Any]) -> None:
        job_id = str(doc["job_id"])
        if doc["state"] == str(SchedState.QUEUED):
            if job_id in self.stored:  # back in the queue: its reservation is gone
                self.delete(job_id)
            return
        self.inner.save(doc)
        self.stored.add(job_id)

    def delete(self, job_id: str) -> None:
        self.inner.delete(job_id)
        self.stored.discard(job_id)

    def load_all(self) -> Iterable[Mapping[str, Any]]:
        docs = [d for d in self.inner.load_all() if d["state"] != str(SchedState.QUEUED)]
        self.stored = {str(d["job_id"]) for d in docs}
        return docs


class LocalScheduler:
    """The scheduler as the API of the same daemon calls it (`ctx.shared["scheduler"]`):
    a submit's admission check and the hand-over of its stored job, each a plain call
    with the job record. Through the local channel each was an `Admit` whose request was
    built as a proto, read back and answered with another, twice a submit, and the
    hand-over went through a thread of its own: ~0.25 ms of the daemon's CPU a submit
    (issue #18). The check still runs before the job is stored and the queueing after,
    so a job is never placed before its record exists."""

    def __init__(self, loop: SchedulingLoop) -> None:
        self.loop = loop

    def admit(self, job: JobRecord) -> tuple[bool, str]:
        """`Admit(check_only)`: (False, the reason) for a job that can never run here. The
        scheduler's `enqueue` of the same request does not check it again."""
        try:
            # the loop's scheduler: a hot standby replaces it when it takes the lead
            result = self.loop.scheduler.admit(job_request(job))
        except SchedulerError as exc:  # what no scheduler takes (fractional GPUs)
            return False, str(exc)
        return result.admitted, result.reason

    def queue(self, job: JobRecord) -> None:
        """`Admit` of a stored job: queued by the loop's next pass, without waiting."""
        self.loop.arrive(job)


class LoopedSchedulerServicer(SchedulerServicer):
    """In the daemon, `Admit` of a stored job queues it and wakes the loop, and
    `Schedule` runs a full pass of the loop (store included) at once."""

    loop: SchedulingLoop | None = None

    def Admit(self, request: Any, context: Any) -> Any:
        resp = super().Admit(request, context)
        if self.loop is not None and not request.check_only:
            self.loop.wake.set()
        return resp

    def Schedule(self, request: Any, context: Any) -> Any:
        if self.loop is None:
            return super().Schedule(request, context)
        placed = self.loop.pass_now()
        fresh = {p.job_id for p in placed}
        gangs = [g for job_id, g in list(self.loop.gangs.items()) if job_id not in fresh]
        return scheduler_pb2.ScheduleResponse(placements=[*placed, *gangs])


def build(ctx: DaemonContext) -> Hosted:
    """Host the Scheduler service and its loop over the jobs store, on the nodes of the
    backend's cluster source (services/scheduler/source.py)."""
    uri = ctx.config.mongodb_uri
    source = cluster_source(ctx.config)
    loop_ref: list[SchedulingLoop] = []
    source.start(lambda: loop_ref[0].wake.set() if loop_ref else None)
    try:
        nodes = source.nodes()
        if not nodes:
            raise ClusterConfigError(
                f"{source.describe()}: no schedulable node (all cordoned, NotReady, tainted "
                "or none registered); add or uncordon a node and start again"
            )
        cluster = Cluster(nodes)
        store = PlacementsOnlyStore(MongoPlacementStore.from_url(uri, database_name(uri)))
        quotas = (
            load_quota_config(ctx.config.quota_config, cluster.gpu_types)
            if ctx.config.quota_config
            else None
        )
    except Exception:
        source.close()
        raise
    # the scaling policy of elastic jobs: the cluster config's `scheduler:` section (a
    # backend that owns its nodes has no cluster config: none)
    scaling = load_scaling_config(source.path) if isinstance(source, ConfigFileSource) else None
    scheduler = GangScheduler(cluster, quotas=quotas, store=store, scaling=scaling)
    servicer = LoopedSchedulerServicer(scheduler)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, ctx.server)
    loop = SchedulingLoop(
        scheduler, servicer, jobs_repository(ctx), ctx.channel("lcm"), source=source
    )
    loop_ref.append(loop)
    servicer.loop = loop
    # what the API of this daemon calls instead of Admit (services/api/hosting.py)
    ctx.shared["scheduler"] = LocalScheduler(loop)
    name = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name

    def stop() -> None:
        if loop.thread.is_alive():
            loop.stop()
        source.close()

    def lead() -> None:
        # Placements the previous leader made since `build` are in MongoDB: a hot standby
        # re-reads them at takeover before its first pass, so nothing is double-booked.
        # the scaling policy too: without it the leader's scheduler never
        # resized elastic jobs nor ordered its queue by it
        fresh = GangScheduler(Cluster(source.nodes()), quotas=quotas, store=store, scaling=scaling)
        with servicer._lock:
            servicer.scheduler = loop.scheduler = fresh
        loop.start()

    return Hosted([name], None, stop, lead=lead)
