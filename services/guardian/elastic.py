"""Scaling a running elastic job (manifest `elastic: {min, max}`), the guardian's side.

`rhizome scale JOB N` reaches the LCM, which checks the job and writes the request to
`deploy/scale_request` (`request_scale`); a later request overwrites an earlier one that
has not started (the later one wins). The job's guardian applies requests one at a time
(`ElasticScaler.apply`, called from its monitor loop), each as a small transaction:

1. RESCALING, with the change in the history; `deploy/scale` records the change in flight.
2. Out: the added ranks start on the nodes of the job's scale gang (placed by the
   scheduler when the API took the request, listed in `placement.scale_gangs`) and must
   reach PROCESSING; their elastic workers join at the next mini-batch boundary.
   In: the highest ranks get SIGTERM, and their workers leave at the end of a mini-batch.
3. Commit: the record's size, learner nodes and gangs change together, PROCESSING with
   `scaled A → B learners` in the history.

A failure in step 2 (a learner that fails or never starts, a halt or delete meanwhile)
stops the added ranks, frees their gang and goes back to PROCESSING on the old size,
saying why. A guardian that finds `deploy/scale` at start (its predecessor died in
step 2) rolls that change back the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from contract import etcd_keys
from contract.env import elastic_worker_rank
from contract.etcd import EtcdClient
from contract.status import LearnerStatus
from services.backends.api import BackendError, JobSpec
from services.store import states
from services.store.jobs import JobRecord, JobsRepository

if TYPE_CHECKING:
    from services.guardian.guardian import Guardian

log = logging.getLogger("rhizome.guardian.elastic")

REQUEST = "scale_request"  # {learners, reason, seq}: the newest request
IN_FLIGHT = "scale"  # {from, to, seq, gang, ranks}: a change in step 2
APPLIED = "scale_applied"  # {seq}: the newest request applied (or refused)
INCARNATIONS = "scale_incarnations"  # rank -> times the rank was added by a scale-out
# A rank added again after it was retired must not find its earlier incarnation's exit
# file (`exit-<generation>-<restart>`): each addition gets restart numbers of its own.
INCARNATION_STRIDE = 1000
JOIN_TIMEOUT_S = 180.0
# How long the leader holds the first ready learners of a scale-out for the others (they
# train meanwhile): a cold learner took 2.6-6.1 s from start to ready on a loaded 2-core
# machine (benchmarks/RESULTS.md, elastic_scaling.py); past it, those that came enter.
JOIN_TOGETHER_S = 15.0
_JOINED = (LearnerStatus.PROCESSING, LearnerStatus.STORING, LearnerStatus.COMPLETED)


class ScaleRefused(ValueError):
    """The job cannot be scaled now; the message says why and what to do."""


class ScaleFailed(RuntimeError):
    """A change could not be completed; it is rolled back."""


def request_scale(
    etcd: EtcdClient, jobs: JobsRepository, job_id: str, learners: int, reason: str
) -> str:
    """The LCM's side of ScaleJob for a running job: record the request for the job's
    guardian (the later request wins). Raises ScaleRefused."""
    job = jobs.get(job_id)
    elastic = job.spec.elastic
    if elastic is None:
        raise ScaleRefused(f"job {job_id} is not elastic; add `elastic: {{min: M, max: N}}`")
    if not elastic.min <= learners <= elastic.max:
        raise ScaleRefused(
            f"learners={learners} is outside the job's elastic bounds [{elastic.min}, "
            f"{elastic.max}]"
        )
    deployed = etcd.get(etcd_keys.deploy_step(job_id, "complete")) is not None
    if job.status not in (states.PROCESSING, states.RESCALING) or not deployed:
        raise ScaleRefused(
            f"job {job_id} is {job.status}: a running job is scaled once it is PROCESSING"
        )
    key = etcd_keys.deploy_step(job_id, REQUEST)
    previous = etcd.get(key)
    seq = etcd.revision() + 1
    etcd.put(key, {"learners": learners, "reason": reason, "seq": seq, "time": time.time()})
    note = ""
    if previous is not None and isinstance(previous.value, dict):
        applied = etcd.get(etcd_keys.deploy_step(job_id, APPLIED))
        done = int(applied.value.get("seq", -1)) if applied is not None else -1
        if int(previous.value.get("seq", -1)) > done:
            note = f" (replaces the pending request for {previous.value.get('learners')})"
    return f"job {job_id}: scaling to {learners} learners{note}"


class ElasticScaler:
    """Applies scale requests for one guardian (see the module docstring)."""

    def __init__(self, guardian: Guardian) -> None:
        self.g = guardian
        self.etcd = guardian.etcd
        self.jobs = guardian.jobs
        self.job_id = guardian.job_id
        self.checked_in_flight = False
        self.stragglers: set[str] = set()  # workers already reported
        self.reported: list[dict[str, Any]] = []  # what `placement.stragglers` holds

    def _get(self, name: str) -> dict[str, Any]:
        entry = self.etcd.get(etcd_keys.deploy_step(self.job_id, name))
        return dict(entry.value) if entry is not None and isinstance(entry.value, dict) else {}

    def _put(self, name: str, value: dict[str, Any]) -> None:
        self.etcd.put(etcd_keys.deploy_step(self.job_id, name), value)

    def report_stragglers(self, job: JobRecord) -> None:
        """A worker that left as a straggler (`elastic/leaves/<w>`, reason `straggler:
        ...`, written by the learner library) is reported to the scheduler: the node of
        its learner goes to the record's `placement.stragglers`, which the scheduling
        loop reads (placements avoid the node for a while), with a line in the history."""
        leaves = self.etcd.get_prefix(etcd_keys.elastic_prefix(self.job_id) + "leaves/")
        nodes = (job.placement or {}).get("learner_nodes") or {}
        for key, entry in leaves.items():
            worker = key.rsplit("/", 1)[-1]
            value = entry.value if isinstance(entry.value, dict) else {}
            reason = str(value.get("reason", ""))
            rank = elastic_worker_rank(worker)
            if worker in self.stragglers or not reason.startswith("straggler") or rank is None:
                continue
            self.stragglers.add(worker)
            node = str(nodes.get(str(rank), ""))
            if not node:
                continue
            self.reported.append(
                {"node": node, "rank": rank, "worker": worker, "reason": reason,
                 "at": time.time()}
            )  # fmt: skip
            self.jobs.update_fields(self.job_id, **{"placement.stragglers": self.reported})
            self.jobs.note(
                self.job_id,
                f"learner {rank} on {node} left as a straggler ({reason}); the scheduler "
                "avoids the node for its next placements",
            )

    def apply(self, job: JobRecord, spec: JobSpec) -> tuple[JobRecord, JobSpec]:
        """Roll back a predecessor's half-done change, then apply the newest request if
        there is one; returns the job and its spec at their (possibly new) size."""
        self.report_stragglers(job)
        if not self.checked_in_flight:
            self.checked_in_flight = True
            flight = self._get(IN_FLIGHT)
            if flight:
                job = self._roll_back(job, spec, flight, "the guardian restarted during it")
        request = self._get(REQUEST)
        seq = int(request.get("seq", -1))
        if not request or seq <= int(self._get(APPLIED).get("seq", -1)):
            return job, spec
        job = self.jobs.get(self.job_id)  # the API wrote the request's gang meanwhile
        current, target = int(job.resources["learners"]), int(request["learners"])
        if job.status not in (states.PROCESSING, states.RESCALING):
            # the learners moved on (STORING) after the request was taken: too late
            self._put(APPLIED, {"seq": seq})
            return self.jobs.note(
                self.job_id, f"scale to {target} learners not applied: the job is {job.status}"
            ), spec
        if target == current:
            self._put(APPLIED, {"seq": seq})
            return self.jobs.note(
                self.job_id, f"already at {target} learners; nothing to scale"
            ), spec
        if job.status != states.RESCALING:
            job = self.jobs.transition(
                self.job_id,
                states.RESCALING,
                f"scaling {current} → {target} learners ({request.get('reason', 'requested')})",
            )
        flight = {"from": current, "to": target, "seq": seq}
        try:
            if target > current:
                flight.update(self._scale_gang(job, current, target))
                self._put(IN_FLIGHT, flight)
                job, spec = self._scale_out(job, spec, flight)
            else:
                self._put(IN_FLIGHT, flight)
                job, spec = self._scale_in(job, spec, current, target)
        except (ScaleFailed, BackendError) as exc:
            log.warning("job %s: scale %d → %d failed: %s", self.job_id, current, target, exc)
            job = self._roll_back(job, spec, flight, str(exc))
        finally:
            self._put(APPLIED, {"seq": seq})
        self.etcd.delete(etcd_keys.deploy_step(self.job_id, IN_FLIGHT))
        return job, spec

    # -- out -------------------------------------------------------------------------------
    def _scale_gang(self, job: JobRecord, current: int, target: int) -> dict[str, Any]:
        """The newest placed gang the API requested for this size, else (no scheduler in
        this platform) the job's first node for every added learner."""
        gangs = (job.placement or {}).get("scale_gangs") or {}
        added = target - current
        for gang_id in sorted(gangs, reverse=True):
            gang = gangs[gang_id] or {}
            if gang.get("state") == "requested" and int(gang.get("target", -1)) == target:
                nodes = list(gang.get("nodes") or [])
                if len(nodes) == added:
                    return {"gang": gang_id, "nodes": nodes}
        if any((g or {}).get("state") == "requested" for g in gangs.values()):
            raise ScaleFailed(f"the scheduler placed no gang of {added} learners for it")
        first = str(((job.placement or {}).get("learner_nodes") or {}).get("0", "local"))
        return {"gang": "", "nodes": [first] * added}

    def _scale_out(
        self, job: JobRecord, spec: JobSpec, flight: dict[str, Any]
    ) -> tuple[JobRecord, JobSpec]:
        current, target = int(flight["from"]), int(flight["to"])
        ranks = list(range(current, target))
        nodes = {str(k): str(v) for k, v in (spec.placement.get("learner_nodes") or {}).items()}
        for rank, node in zip(ranks, flight["nodes"], strict=True):
            nodes[str(rank)] = node
        bigger = dataclasses.replace(
            spec, learners=target, placement={**spec.placement, "learner_nodes": nodes}
        )
        incarnations = {str(k): int(v) for k, v in self._get(INCARNATIONS).items()}
        for rank in ranks:
            incarnations[str(rank)] = incarnations.get(str(rank), 0) + 1
        self._put(INCARNATIONS, incarnations)
        # the learners start together but get ready at different times: the leader admits
        # them together (one re-form), waiting for the last at most JOIN_TOGETHER_S
        if len(ranks) > 1:
            self.etcd.put(
                etcd_keys.elastic_expect(self.job_id),
                {"count": len(ranks), "deadline": time.time() + JOIN_TOGETHER_S},
            )
        now = time.monotonic()
        for rank in ranks:
            self.etcd.delete(etcd_keys.learner_status(self.job_id, rank))  # a retired one's
            restart = INCARNATION_STRIDE * incarnations[str(rank)]
            self.g.handles[rank] = self.g.backend.start_learner(bigger, rank, restart)
            self.g.started_at[rank] = now
        # a learner joins once its script imported torch and built its model: on a busy
        # machine that takes a while
        try:
            self._wait_processing(ranks, now + JOIN_TIMEOUT_S)
        finally:  # admitted (the leader deleted it) or failed: hold nobody for them
            self.etcd.delete(etcd_keys.elastic_expect(self.job_id))
        fields: dict[str, Any] = {
            "resources.learners": target,
            "placement.learner_nodes": nodes,
        }
        if flight.get("gang"):
            gang = f"placement.scale_gangs.{flight['gang']}"
            fields[f"{gang}.state"] = "deployed"
            fields[f"{gang}.ranks"] = ranks
        self.jobs.update_fields(self.job_id, **fields)
        where = ", ".join(sorted(set(flight["nodes"])))
        job = self.jobs.transition(
            self.job_id,
            states.PROCESSING,
            f"scaled {current} → {target} learners: learner{'s' * (len(ranks) > 1)} "
            f"{', '.join(map(str, ranks))} joined on {where}",
        )
        return job, bigger

    def _wait_processing(self, ranks: list[int], deadline: float) -> None:
        """Until every added learner's elastic worker is a member of the job's workers;
        ScaleFailed if one fails, never joins, or a halt or delete comes meanwhile."""
        while True:
            action = self.g.control().get("action")
            if action in ("halt", "delete"):
                raise ScaleFailed(f"a {action} was requested meanwhile")
            if self.g.terminate.is_set():
                raise ScaleFailed("the platform is shutting down")
            joined = self._members()
            waiting = []
            for rank in ranks:
                entry = self.etcd.get(etcd_keys.learner_status(self.job_id, rank))
                value = entry.value if entry is not None and isinstance(entry.value, dict) else {}
                status = LearnerStatus.parse(value.get("status"), LearnerStatus.STARTING)
                if status in (LearnerStatus.FAILED, LearnerStatus.HALTED):
                    lines = self.g.backend.log_tail(self.g.job_dir, rank, lines=1)
                    raise ScaleFailed(
                        f"learner {rank} exited with code {value.get('exit_code')}"
                        + (f": {lines[-1]}" if lines else "")
                    )
                if status not in _JOINED or rank not in joined:
                    # a controller that died before it wrote any status (at its start)
                    # would otherwise be waited for until JOIN_TIMEOUT_S
                    handle = self.g.handles.get(rank)
                    code = None if handle is None else self.g.backend.learner_exited(handle)
                    if code is not None:
                        raise ScaleFailed(
                            f"learner {rank}'s controller exited with code {code} before it "
                            f"joined (its log: {self.g.job_dir}/learners/{rank}/controller.log)"
                        )
                    waiting.append(rank)
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise ScaleFailed(
                    f"learner{'s' * (len(waiting) > 1)} {waiting} did not join within "
                    f"{JOIN_TIMEOUT_S:.0f} s"
                )
            self.g.wake.wait(0.3)
            self.g.wake.clear()

    def _members(self) -> set[int]:
        """The ranks whose elastic worker is a member of the current generation (the
        workers' state, `elastic/state`; names from `contract.env.elastic_worker_name`)."""
        entry = self.etcd.get(etcd_keys.elastic_state(self.job_id))
        value = entry.value if entry is not None and isinstance(entry.value, dict) else {}
        ranks = (elastic_worker_rank(str(m)) for m in value.get("members") or [])
        return {r for r in ranks if r is not None}

    # -- in --------------------------------------------------------------------------------
    def _scale_in(
        self, job: JobRecord, spec: JobSpec, current: int, target: int
    ) -> tuple[JobRecord, JobSpec]:
        """The highest ranks leave: SIGTERM, and the elastic worker leaves at the end of
        its mini-batch (the library's graceful leave); what is left after the grace is
        killed, and the survivors redo its unfinished mini-batch."""
        ranks = list(range(target, current))
        # Every retired rank is stopped at once: their workers then leave at the same
        # mini-batch boundary, one re-form. One after the other (each stop waits for its
        # learner's exit) re-formed once per rank: 4 -> 2 stalled the survivors twice
        # (2.95 iterations against 1.16 bare, benchmarks/elastic_scaling.py --platform).
        with ThreadPoolExecutor(max_workers=len(ranks), thread_name_prefix="scale-in") as pool:
            stops = [
                pool.submit(self.g.backend.stop_learner, self.job_id, rank, spec.grace_s)
                for rank in reversed(ranks)
            ]
            for stop in stops:
                stop.result()  # a backend's refusal (BackendError) rolls the change back
        for rank in ranks:
            self.etcd.delete(etcd_keys.learner_status(self.job_id, rank))
            self.g.handles.pop(rank, None)
        nodes = {
            str(k): str(v)
            for k, v in (spec.placement.get("learner_nodes") or {}).items()
            if int(k) < target
        }
        fields: dict[str, Any] = {"resources.learners": target, "placement.learner_nodes": nodes}
        for gang_id, gang in ((job.placement or {}).get("scale_gangs") or {}).items():
            held = [int(r) for r in (gang or {}).get("ranks") or []]
            if held and min(held) >= target:  # all its learners retired: the scheduler frees it
                fields[f"placement.scale_gangs.{gang_id}"] = None
        self.jobs.update_fields(self.job_id, **fields)
        smaller = dataclasses.replace(
            spec, learners=target, placement={**spec.placement, "learner_nodes": nodes}
        )
        job = self.jobs.transition(
            self.job_id,
            states.PROCESSING,
            f"scaled {current} → {target} learners: learner{'s' * (len(ranks) > 1)} "
            f"{', '.join(map(str, ranks))} left at a mini-batch boundary",
        )
        return job, smaller

    # -- rollback --------------------------------------------------------------------------
    def _roll_back(
        self, job: JobRecord, spec: JobSpec, flight: dict[str, Any], why: str
    ) -> JobRecord:
        """Undo a scale-out that did not complete (a scale-in has nothing to undo: the
        record keeps its old size until the learners are gone)."""
        current, target = int(flight.get("from", 0)), int(flight.get("to", 0))
        for rank in range(current, target):
            self.g.backend.stop_learner(self.job_id, rank, grace_s=1.0)
            self.etcd.delete(etcd_keys.learner_status(self.job_id, rank))
            self.g.handles.pop(rank, None)
        if flight.get("gang"):
            self.jobs.update_fields(
                self.job_id, **{f"placement.scale_gangs.{flight['gang']}": None}
            )
        self.etcd.delete(etcd_keys.deploy_step(self.job_id, IN_FLIGHT))
        message = (
            f"scale {current} → {target} learners rolled back: {why}; the job runs on "
            f"{current} learners"
        )
        current_job = self.jobs.get(self.job_id)
        if current_job.status == states.RESCALING:
            return self.jobs.transition(self.job_id, states.PROCESSING, message)
        return self.jobs.note(self.job_id, message)
