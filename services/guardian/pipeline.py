"""The guardian's part in a pipeline job (docs/lifecycle.md, docs/runtime.md).

Failover is the runtime's, not the guardian's: a pipeline learner that was killed
(preempted) or evicted by its peers is not restarted. The guardian records the
preemption, writes into the history who serves the lost stage once the runtime's state
has it among the dead, and starts a replacement that joins as a standby
(reconfiguration). Only the runtime's fatal loss (a stage and its shadow) makes the
guardian act on the whole job: every learner restarts from the latest checkpoint.

Split out of services/guardian/guardian.py, which calls `PipelineFailover.losses` each
monitoring round of a pipeline job and `PipelineFailover.fatal` when every learner was
lost; the state lives in etcd (the deploy keys below), so a restarted guardian resumes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from contract import etcd_keys
from contract.env import JOIN_TOKEN
from contract.status import PREEMPTION_EXIT_CODES, ExitCode, LearnerStatus
from services.backends.api import BackendError, JobSpec
from services.store import states
from services.store.jobs import JobRecord

if TYPE_CHECKING:  # the guardian imports this module
    from services.guardian.guardian import Guardian

log = logging.getLogger("rhizome.guardian")

# A pipeline job's lost learners: rank -> {"code", "reported"} (kept in etcd so that a
# restarted guardian neither records a preemption twice nor repeats a history entry).
LOST = "lost"
# A pipeline job's replaced learners: rank -> {"count", "joined"} (replacements started,
# the generation whose admission of the last one the history already shows).
REPLACED = "replaced"
# A pipeline job's joiners (standbys, replacements) that ended unadmitted: [rank, ...]
# (they count as COMPLETED: a standby refused at the end of the job is no preemption).
RETIRED = "retired"
# A pipeline job's restarts from the checkpoint after fatal losses: {"count"}.
PIPELINE_RESTARTS = "pipeline_restarts"
# A pipeline job's growths the history shows: {pipelines: generation} (`grown_at` of the
# runtime's state: P standbys added a whole pipeline).
GROWN = "grown"
# Exit codes of a pipeline learner the runtime fails over without (the worker was
# preempted, or its peers declared it dead and it left).
PIPELINE_LOSS_CODES = PREEMPTION_EXIT_CODES | {int(ExitCode.EVICTED)}

# What `losses` and `fatal` return: the job record and the lost learners still not
# replaced, or the guardian's exit code when the job ended.
Outcome = tuple[JobRecord, dict[str, dict[str, Any]]] | int


# How long a round waits for an admitted joiner's ticket to be marked used (see
# `_ticket_holder`'s caller): the runtime writes it milliseconds after the admission.
TICKET_LOOKS = 20
TICKET_LOOK_S = 0.1


def _ticket_holder(tickets: dict[int, dict[str, Any]], slot: str, generation: int) -> int | None:
    """The learner whose admission ticket was used for `slot` at `generation`, if any."""
    return next(
        (
            rank
            for rank, t in sorted(tickets.items())
            if t.get("used_at") == generation and str(t.get("slot")) == slot
        ),
        None,
    )


class PipelineFailover:
    """The pipeline part of one job's guardian (it uses the guardian's etcd, records,
    backend and learner handles, and ends the job through it)."""

    def __init__(self, guardian: Guardian) -> None:
        self.guardian = guardian
        self.job_id = guardian.job_id

    def start_learner(self, spec: JobSpec, rank: int, incarnation: int) -> int:
        """Start one learner of a pipeline job. A standby (rank >= stages × pipelines,
        `pipeline.standbys`) gets a fresh admission ticket (`runtime/tickets/<rank>`, its
        token in the learner's environment): the runtime makes it build the model, import
        what it needs and queue under `runtime/standbys/<rank>` until a slot is lost, then
        take it without a cold start (learner/runtime/reconfigure.py)."""
        pipe = spec.manifest.pipeline
        if pipe is None or rank < pipe.workers:
            return self.guardian.backend.start_learner(spec, rank, incarnation)
        if rank >= pipe.workers + pipe.standbys:
            raise BackendError(f"learner {rank}: the job has {pipe.standbys} standbys only")
        return self.start_joiner(spec, rank, incarnation)

    def restart_controller(self, spec: JobSpec, rank: int, incarnation: int) -> int:
        """A new controller for learner `rank`, whose controller died (the platform's
        failure: Guardian.learner_statuses); `incarnation` is what a job without a
        pipeline restarts it as. A pipeline learner's controller is restarted as the
        incarnation the pipeline last started for the rank (a replacement's, or a restart
        after a fatal loss: `replaced/<rank>.incarnation`) and, for a joiner, with the
        token of its ticket: the new controller then re-adopts the worker if it still
        runs, or, if the worker went with its controller, records it KILLED, so that it
        comes back through the replacement path (a fresh ticket, `replace_lost`). Restarted
        as another incarnation, the controller ran the command again: a worker without a
        ticket, which the runtime refuses once it formed (`job already at generation N`),
        and the job failed. Before the pipeline formed it is started as at deploy."""
        pipe = spec.manifest.pipeline
        if pipe is None:
            return self.start_learner(spec, rank, incarnation)
        entry = self.guardian.etcd.get(etcd_keys.deploy_step(self.job_id, REPLACED))
        replaced: dict[str, dict[str, Any]] = dict(entry.value) if entry is not None else {}
        current = int(replaced.get(str(rank), {}).get("incarnation", 0))
        ticket = self.tickets().get(rank)
        if ticket is None:
            if rank >= pipe.workers:  # a standby whose ticket is gone: issue one
                return self.start_joiner(spec, rank, current)
            started = self.guardian.backend.start_learner(spec, rank, current)
        else:
            env = {**spec.platform_env, JOIN_TOKEN: str(ticket.get("token", ""))}
            started = self.guardian.backend.start_learner(
                dataclasses.replace(spec, platform_env=env), rank, current
            )
        if self.formed():
            self.guardian.jobs.note(
                self.job_id,
                f"learner {rank}'s controller died after the pipeline formed; a new controller "
                f"of the same incarnation ({current}) re-adopts its worker, or reports it "
                "gone (then the runtime fails over and a replacement joins)",
            )
        return started

    def formed(self) -> bool:
        """Whether the runtime formed its first generation (a generation past 0, or its
        rendezvous store written): from then on a worker joins only with a ticket."""
        state = self.runtime_state()
        return int(state.get("generation") or 0) > 0 or bool(
            self.guardian.etcd.get_prefix(etcd_keys.runtime_store_prefix(self.job_id))
        )

    def start_joiner(self, spec: JobSpec, rank: int, incarnation: int) -> int:
        """A learner that joins the running runtime with a ticket: a replacement of a lost
        slot (rank = the slot) or a standby (rank beyond the workers)."""
        token = os.urandom(16).hex()
        ticket: dict[str, Any] = {
            "token": token,
            "generation": int(self.runtime_state().get("generation") or 0),
        }
        pipe = spec.manifest.pipeline
        if pipe is not None and pipe.max_pipelines > pipe.pipelines:
            # `pipeline.max_pipelines`: this joiner may, with P - 1 other queued standbys,
            # grow the job by a whole pipeline (learner/runtime/reconfigure.py)
            ticket["max_pipelines"] = pipe.max_pipelines
        self.guardian.etcd.put(etcd_keys.runtime_ticket(self.job_id, rank), ticket)
        return self.guardian.backend.start_learner(
            dataclasses.replace(spec, platform_env={**spec.platform_env, JOIN_TOKEN: token}),
            rank,
            incarnation,
        )

    def tickets(self) -> dict[int, dict[str, Any]]:
        """The runtime's admission tickets by learner: `used_at` and `slot` once admitted."""
        prefix = etcd_keys.runtime_prefix(self.job_id) + "tickets/"
        out: dict[int, dict[str, Any]] = {}
        for key, entry in self.guardian.etcd.get_prefix(prefix).items():
            name = key[len(prefix) :]
            if name.isdigit() and isinstance(entry.value, dict):
                out[int(name)] = entry.value
        return out

    def unadmitted_joiner_left(
        self, job: JobRecord, spec: JobSpec, rank: int, code: int, lost: dict[str, dict[str, Any]]
    ) -> tuple[JobRecord, bool]:
        """A joiner (standby or replacement) that ended before it was admitted is no
        worker's loss. Refused because the job finishes (`done/<g>/*` exists) or for a
        stale ticket: it retired unused, which is no preemption and does not hold the job
        back (its status counts as COMPLETED). Killed while it waited: a lost standby,
        replaced as one within the job's budget. True when `rank` was such a joiner."""
        ticket = self.tickets().get(rank)
        if ticket is None or ticket.get("used_at") is not None:
            return job, False
        if code in PREEMPTION_EXIT_CODES:
            self.guardian.record_preemption(spec, rank, code, time.monotonic())
            lost[str(rank)] = {"code": code, "reported": True}
            note = f"standby learner {rank} lost while it waited for a slot (exit {code})"
        else:
            finishing = bool(
                self.guardian.etcd.get_prefix(etcd_keys.runtime_prefix(self.job_id) + "done/")
            )
            why = "the job finished before a slot was lost" if finishing else "refused admission"
            # a joiner that was not admitted waited as a standby
            note = f"standby learner {rank} retired unused: {why}"
        self.guardian.etcd.delete(etcd_keys.runtime_ticket(self.job_id, rank))
        return self.guardian.jobs.note(self.job_id, note), True

    def queued_standbys(self) -> bool:
        """Whether a joiner waits for a lost slot (`runtime/standbys/*`, under its lease)."""
        prefix = etcd_keys.runtime_prefix(self.job_id) + "standbys/"
        return bool(self.guardian.etcd.get_prefix(prefix))

    def runtime_state(self) -> dict[str, Any]:
        """The pipeline runtime's cluster state (`runtime/state`, written by the workers by
        compare-and-set: generation, stages, pipelines, dead, fatal), or {}."""
        entry = self.guardian.etcd.get(etcd_keys.runtime_prefix(self.job_id) + "state")
        return entry.value if entry is not None and isinstance(entry.value, dict) else {}

    def losses(self, job: JobRecord, spec: JobSpec, statuses: dict[int, LearnerStatus]) -> Outcome:
        """A pipeline learner that ended FAILED is not restarted. Killed (preempted) or
        evicted by its peers: the preemption is recorded and, once the runtime's state has
        it among the dead, the history says who serves its stage now; the job goes on.
        The runtime's fatal loss (a stage and its shadow) fails the job with the runtime's
        one-line reason; any other exit code fails it as a learner failure would."""
        key = etcd_keys.deploy_step(self.job_id, LOST)
        entry = self.guardian.etcd.get(key)
        lost: dict[str, dict[str, Any]] = dict(entry.value) if entry is not None else {}
        changed = False
        state = self.runtime_state()
        now = time.monotonic()
        retired_key = etcd_keys.deploy_step(self.job_id, RETIRED)
        got = self.guardian.etcd.get(retired_key)
        retired: set[str] = {str(r) for r in (got.value or [])} if got is not None else set()
        for rank, status in statuses.items():
            if str(rank) in retired:
                statuses[rank] = LearnerStatus.COMPLETED
                continue
            if status != LearnerStatus.FAILED or str(rank) in lost:
                continue
            value = self.guardian.etcd.get(etcd_keys.learner_status(self.job_id, rank))
            code = int((value.value or {}).get("exit_code") or 1) if value else 1
            if not state.get("fatal") and code in PIPELINE_LOSS_CODES:
                job, left = self.unadmitted_joiner_left(job, spec, rank, code, lost)
                if left:
                    changed = True
                    if str(rank) not in lost:
                        retired.add(str(rank))
                        statuses[rank] = LearnerStatus.COMPLETED
                        self.guardian.etcd.put(retired_key, sorted(retired))
                    continue
                restarted = self.restart_unformed(job, spec, rank, code, statuses)
                if restarted is not None:
                    job = restarted
                    continue
            if code == ExitCode.FATAL or state.get("fatal"):
                return self.fatal(job, spec, state, rank, code)
            if code not in PIPELINE_LOSS_CODES:
                return self.guardian.fail_learner(rank, code, 0)
            self.guardian.record_preemption(spec, rank, code, now)
            # `slot`: the runtime worker the learner served — its own rank, or the slot a
            # standby (or a replacement queued as one) took; `since`: the generation
            # it was admitted into that slot at (-1: a first incarnation). Read now,
            # before a new ticket for the rank replaces its used one. A later admission
            # into the slot means a standby took it, perhaps before this guardian saw
            # the slot among the dead (see below). (Not the admission the history last
            # showed: the standby's may be shown before this loss is seen.)
            slot, since = self.slot_of(rank)
            lost[str(rank)] = {"code": code, "reported": False, "since": since, "slot": slot}
            changed = True
            log.info("job %s: pipeline learner %d lost (exit %d)", self.job_id, rank, code)
        if state.get("fatal"):
            return self.fatal(job, spec, state, -1, ExitCode.FATAL)
        job = self.note_growth(job, state)
        joined_at = {str(k): int(v) for k, v in (state.get("joined_at") or {}).items()}
        for rank_s, info in sorted(lost.items()):
            if info.get("reported"):
                continue
            slot_s = str(info.get("slot", rank_s))
            if int(slot_s) in (state.get("dead") or []):
                generation = int(state.get("generation") or 0)
            elif joined_at.get(slot_s, -1) > int(info.get("since", 1 << 62)):
                # a waiting standby took the slot already: the failover was the
                # generation before its admission
                generation = joined_at[slot_s] - 1
            else:
                continue
            message = self.failover_message(
                int(rank_s),
                {**state, "generation": generation},
                slot=int(slot_s),
                serving=self.serving(),
            )
            job = self.guardian.jobs.note(self.job_id, message)
            info["reported"] = True
            changed = True
        job = self.replace_lost(job, spec, lost, state, statuses)
        if changed:
            self.guardian.etcd.put(key, lost)
        return job, lost

    def note_growth(self, job: JobRecord, state: dict[str, Any]) -> JobRecord:
        """Write each growth of the runtime's state (`grown_at`: P queued standbys added a
        whole pipeline, learner/runtime/reconfigure.py) into the history once:
        `pipeline grown to 2 pipelines: learners 2, 3 took slots 2, 3 (generation 1)`.
        The learners are the state's `grown` for the latest growth (the ticket numbers,
        which are the learners' ranks), else those whose tickets were used for the new
        slots at that generation."""
        grown_at = {str(k): int(v) for k, v in (state.get("grown_at") or {}).items()}
        if not grown_at:
            return job
        key = etcd_keys.deploy_step(self.job_id, GROWN)
        entry = self.guardian.etcd.get(key)
        noted: dict[str, int] = dict(entry.value) if entry is not None else {}
        stages = int(state.get("stages") or 1)
        changed = False
        for count_s, gen in sorted(grown_at.items(), key=lambda kv: int(kv[0])):
            if noted.get(count_s) == gen:
                continue
            count = int(count_s)
            slots = list(range(stages * (count - 1), stages * count))
            if count == int(state.get("pipelines") or 0):
                learners = [int(r) for r in state.get("grown") or []]
            else:
                by_slot = {
                    int(t["slot"]): rank
                    for rank, t in self.tickets().items()
                    if t.get("used_at") == gen and t.get("slot") is not None
                }
                learners = [by_slot[s] for s in slots if s in by_slot]
            names = ", ".join(str(r) for r in learners) or "(unknown)"
            job = self.guardian.jobs.note(
                self.job_id,
                f"pipeline grown to {count} pipelines: learners {names} took slots "
                f"{', '.join(str(s) for s in slots)} (stages 0..{stages - 1} of pipeline "
                f"{count - 1}) from the queued standbys, without a cold start "
                f"(generation {gen})",
            )
            log.info("job %s: pipeline grown to %d pipelines", self.job_id, count)
            noted[count_s] = gen
            changed = True
        if changed:
            self.guardian.etcd.put(key, noted)
        return job

    def replace_lost(
        self,
        job: JobRecord,
        spec: JobSpec,
        lost: dict[str, dict[str, Any]],
        state: dict[str, Any],
        statuses: dict[int, LearnerStatus],
    ) -> JobRecord:
        """Reconfiguration (docs/lifecycle.md): a lost learner whose failover the history
        shows gets a replacement, at most `max_learner_restarts` times per rank. The
        replacement is a new incarnation of the rank on the node the scheduler chose for
        a gang of one (ReplaceLearner, asked through `Guardian.replacements`; the lost
        learner's node when the scheduler cannot answer after its retries, or when the
        platform has no scheduler: services/guardian/replacement.py); it
        carries a fresh admission ticket (`runtime/tickets/<rank>`, its token in the
        learner's environment), joins the runtime as a standby and takes its stage back
        at the next step boundary. Its admission (`joined_at` in the runtime's state) is
        written into the history once."""
        key = etcd_keys.deploy_step(self.job_id, REPLACED)
        entry = self.guardian.etcd.get(key)
        replaced: dict[str, dict[str, Any]] = dict(entry.value) if entry is not None else {}
        changed = False
        joined_at = {str(k): int(v) for k, v in (state.get("joined_at") or {}).items()}
        tickets = self.tickets() if joined_at else {}
        for slot_s, gen in sorted(joined_at.items()):
            info = replaced.setdefault(slot_s, {})
            if gen <= int(info.get("joined", -1)):
                continue
            # who took the slot: the learner whose ticket was used for it at `gen`. The
            # joiner marks its ticket just after its compare-and-set on the state, so a
            # round between the two sees the slot joined and no ticket used yet: look
            # again for a moment rather than name the slot's own learner (a standby's
            # admission was once written as "replaced by its own learner")
            joiner = _ticket_holder(tickets, slot_s, gen)
            for _ in range(TICKET_LOOKS):
                if joiner is not None:
                    break
                time.sleep(TICKET_LOOK_S)
                tickets = self.tickets()
                joiner = _ticket_holder(tickets, slot_s, gen)
            if joiner is None:
                joiner = int(slot_s)
            stages = int(state["stages"])
            stage, pipeline = int(slot_s) % stages, int(slot_s) // stages
            if joiner == int(slot_s):
                message = (
                    f"learner {slot_s} replaced: stage {stage} served by its own learner "
                    f"again, every block has a replica (generation {gen})"
                )
            else:
                message = (
                    f"standby learner {joiner} took over stage {stage} of pipeline {pipeline} "
                    f"(learner {slot_s}'s slot) without a cold start, every block has a "
                    f"replica (generation {gen})"
                )
            job = self.guardian.jobs.note(self.job_id, message)
            info["joined"] = gen
            changed = True
        for rank_s, info in sorted(lost.items()):
            rank = int(rank_s)
            slot_s = str(info.get("slot", rank_s))
            done = int(replaced.get(rank_s, {}).get("count", 0))
            if not info.get("reported") or done >= spec.manifest.max_learner_restarts:
                continue
            if int(slot_s) in (state.get("dead") or []) and self.queued_standbys():
                # a waiting standby takes the slot first (in milliseconds); the replacement
                # is then issued at the new generation and queues as the next standby
                # (issued before that admission, the runtime would refuse it as stale)
                continue
            fresh = self.runtime_state().get("joined_at") or {}
            if int(fresh.get(slot_s, -1)) > int(replaced.get(slot_s, {}).get("joined", -1)):
                # a standby was admitted into the slot since `state` was read: the history
                # names it first (next round), then the replacement queues behind it
                continue
            # where it runs: the scheduler's choice of another node (ReplaceLearner), or,
            # once asking has failed, the lost node (services/guardian/replacement.py)
            current = self.guardian.jobs.get(self.job_id)
            where = self.guardian.replacements.decide(
                self.job_id, rank, dict(current.placement or {})
            )
            if where is None:
                continue  # the scheduler is asked again in a later round
            if where.chosen_by_scheduler:
                job = self.guardian.jobs.update_fields(self.job_id, placement=where.placement)
            if where.note:
                job = self.guardian.jobs.note(self.job_id, where.note)
            status_key = etcd_keys.learner_status(self.job_id, rank)
            final = self.guardian.etcd.get(status_key)  # the lost incarnation's FAILED status
            self.guardian.etcd.delete(status_key)  # the new controller creates its own
            # the restart number of the new incarnation only grows (a checkpoint restart
            # also starts new incarnations)
            incarnation = int(replaced.get(rank_s, {}).get("incarnation", done)) + 1
            try:
                self.guardian.handles[rank] = self.start_joiner(
                    dataclasses.replace(spec, placement=where.placement), rank, incarnation
                )
            except BackendError as exc:
                # the job goes on without redundancy there; the history says why
                if final is not None:
                    self.guardian.etcd.put(status_key, final.value)
                replaced[rank_s] = {**replaced.get(rank_s, {}), "count": done + 1}
                self.guardian.etcd.put(key, replaced)
                return self.guardian.jobs.note(
                    self.job_id, f"learner {rank} lost: its replacement could not start: {exc}"
                )
            self.guardian.started_at[rank] = time.monotonic()
            statuses[rank] = LearnerStatus.STARTING
            replaced[rank_s] = {
                **replaced.get(rank_s, {}),
                "count": done + 1,
                "incarnation": incarnation,
            }
            del lost[rank_s]
            self.guardian.etcd.put(etcd_keys.deploy_step(self.job_id, LOST), lost)
            changed = True
            log.info(
                "job %s: started replacement %d of pipeline learner %d", self.job_id, done + 1, rank
            )
            job = self.guardian.jobs.note(
                self.job_id,
                f"learner {rank} lost: a replacement joins as a standby "
                f"(replacement {done + 1} of at most {spec.manifest.max_learner_restarts})",
            )
        if changed:
            self.guardian.etcd.put(key, replaced)
        return job

    def restart_unformed(
        self,
        job: JobRecord,
        spec: JobSpec,
        rank: int,
        code: int,
        statuses: dict[int, LearnerStatus],
    ) -> JobRecord | None:
        """A worker lost before the runtime formed its first generation (generation 0,
        nothing in its rendezvous store yet: the workers are still registering, at deploy
        or right after a restart from the checkpoint) has nobody to fail over to and no
        slot to rejoin, and the others wait for it to register (120 s, then they fail
        with exit 1, which failed the job). It is restarted in place as a new
        incarnation, within the rank's replacement budget, saying so. None: not such a
        loss (the pipeline formed, a standby, the budget spent): any other loss."""
        pipe = spec.manifest.pipeline
        if pipe is None or rank >= pipe.workers:
            return None
        if self.formed():
            return None
        key = etcd_keys.deploy_step(self.job_id, REPLACED)
        entry = self.guardian.etcd.get(key)
        replaced: dict[str, dict[str, Any]] = dict(entry.value) if entry is not None else {}
        info = replaced.get(str(rank), {})
        done, limit = int(info.get("count", 0)), spec.manifest.max_learner_restarts
        if done >= limit:
            return None
        self.guardian.record_preemption(spec, rank, code, time.monotonic())
        self.guardian.etcd.delete(etcd_keys.learner_status(self.job_id, rank))
        incarnation = int(info.get("incarnation", done)) + 1
        self.guardian.handles[rank] = self.start_learner(spec, rank, incarnation)
        self.guardian.started_at[rank] = time.monotonic()
        statuses[rank] = LearnerStatus.STARTING
        replaced[str(rank)] = {**info, "count": done + 1, "incarnation": incarnation}
        self.guardian.etcd.put(key, replaced)
        log.info("job %s: pipeline learner %d lost before the pipeline formed", self.job_id, rank)
        return self.guardian.jobs.note(
            self.job_id,
            f"learner {rank} lost before the pipeline formed (exit {code}); restarted in "
            f"place, the others wait for it to register (restart {done + 1} of at most {limit})",
        )

    def slot_of(self, rank: int) -> tuple[int, int]:
        """The runtime worker (slot) learner `rank` serves and the generation it was
        admitted at: the slot its used admission ticket names (a standby, or a
        replacement that queued and took a slot), else its own rank since the start
        (-1)."""
        ticket = self.tickets().get(rank) or {}
        if ticket.get("used_at") is not None:
            return int(ticket.get("slot", rank)), int(ticket["used_at"])
        return rank, -1

    def serving(self) -> dict[int, int]:
        """slot -> the learner serving it, where that is not the slot's own rank (the
        latest admission into the slot by a used ticket)."""
        latest: dict[int, tuple[int, int]] = {}
        for rank, ticket in self.tickets().items():
            if ticket.get("used_at") is None or ticket.get("slot") is None:
                continue
            slot, used = int(ticket["slot"]), int(ticket["used_at"])
            if slot not in latest or used > latest[slot][0]:
                latest[slot] = (used, rank)
        return {slot: rank for slot, (_, rank) in latest.items()}

    @staticmethod
    def failover_message(
        rank: int,
        state: dict[str, Any],
        slot: int | None = None,
        serving: dict[int, int] | None = None,
    ) -> str:
        """`learner 1 preempted; stage 1 now served by learner 0 (generation 1)`: the shadow
        (the previous stage of the same pipeline, which held the replica) took it over.
        A learner that served another slot (a standby that had taken it) says which:
        `learner 2 preempted (it served stage 1 of pipeline 0, learner 1's slot); ...`;
        the shadow is named by the learner serving its slot (`serving`)."""
        stages = int(state.get("stages") or 1)
        slot = rank if slot is None else slot
        stage, pipeline = slot % stages, slot // stages
        shadow_slot = pipeline * stages + (stage - 1) % stages
        shadow = (serving or {}).get(shadow_slot, shadow_slot)
        served = (
            ""
            if slot == rank
            else f" (it served stage {stage} of pipeline {pipeline}, learner {slot}'s slot)"
        )
        return (
            f"learner {rank} preempted{served}; stage {stage} now served by learner {shadow} "
            f"(generation {state.get('generation')})"
        )

    def fatal(
        self, job: JobRecord, spec: JobSpec, state: dict[str, Any], rank: int, code: int
    ) -> Outcome:
        """A stage and its shadow were both lost (the runtime's `FatalFailure`), or every
        learner was: the job restarts from the latest checkpoint — every learner stopped
        and started again (a new incarnation of each rank), the runtime's keys erased, so
        the workers create generation 0 anew and load the latest complete block checkpoint
        (learner/runtime/block_checkpoint.py, under the job's checkpoint directory).
        Recorded in the history as RECOVERING then PROCESSING; at most
        `max_learner_restarts` times, then the job fails with the runtime's reason."""
        reason = state.get("fatal") or "a stage and its shadow were lost"
        self.guardian.backend.stop_learners(self.job_id, grace_s=2.0)
        key = etcd_keys.deploy_step(self.job_id, PIPELINE_RESTARTS)
        entry = self.guardian.etcd.get(key)
        done = int(entry.value.get("count", 0)) if entry is not None else 0
        limit = spec.manifest.max_learner_restarts
        if done >= limit:
            lines = self.guardian.backend.log_tail(self.guardian.job_dir, rank) if rank >= 0 else []
            return self.guardian.finish(
                states.FAILED,
                f"pipeline runtime: fatal: {reason}"
                + (f" (after {done} restarts from the checkpoint)" if done else ""),
                exit_code=int(ExitCode.FATAL if code == ExitCode.FATAL else code),
                last_log_lines=lines,
            )
        self.guardian.etcd.put(key, {"count": done + 1})
        job = self.guardian.jobs.transition(
            self.job_id,
            states.RECOVERING,
            f"pipeline runtime: fatal: {reason}; restarting every learner from the latest "
            f"checkpoint (restart {done + 1} of at most {limit})",
        )
        # Nothing of the lost configuration may reach the new one: its generations,
        # members, rendezvous store, the learners' final statuses, the losses recorded.
        self.guardian.etcd.delete_prefix(etcd_keys.runtime_prefix(self.job_id))
        self.guardian.etcd.put(
            etcd_keys.runtime_config(self.job_id), self.guardian.runtime_config(spec)
        )
        self.guardian.etcd.delete_prefix(etcd_keys.learner_prefix(self.job_id))
        self.guardian.etcd.put(etcd_keys.deploy_step(self.job_id, LOST), {})
        self.guardian.etcd.delete(etcd_keys.deploy_step(self.job_id, RETIRED))
        # the runtime starts again at the manifest's D: its growths are noted anew
        self.guardian.etcd.delete(etcd_keys.deploy_step(self.job_id, GROWN))
        replaced_key = etcd_keys.deploy_step(self.job_id, REPLACED)
        got = self.guardian.etcd.get(replaced_key)
        replaced: dict[str, dict[str, Any]] = dict(got.value) if got is not None else {}
        now = time.monotonic()
        for r in range(spec.learners):
            # a new incarnation of every rank: its restart number only grows
            info = replaced.get(str(r), {})
            incarnation = int(info.get("incarnation", info.get("count", 0))) + 1
            replaced[str(r)] = {**info, "incarnation": incarnation, "joined": -1}
            # standbys get fresh tickets: the runtime's keys, old tickets too, are gone
            self.guardian.handles[r] = self.start_learner(spec, r, incarnation)
            self.guardian.started_at[r] = now
        self.guardian.etcd.put(replaced_key, replaced)
        job = self.guardian.jobs.transition(
            self.job_id,
            states.PROCESSING,
            "every learner restarted; the runtime resumes from its latest complete checkpoint",
        )
        return job, {}
