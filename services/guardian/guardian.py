"""The guardian: one per job, the job's delegate from deploy to teardown (FfDL §3).

A guardian is a process (`python -m services.guardian --job-id J ...`) started and
restarted by the LCM. It holds the job's guardian key in etcd (created if absent, under
its own lease), so two guardians never serve one job; if it dies, the lease — revoked at
once by a supervisor that saw it die, or expiring after its TTL — frees the job for the
next one.

Deploy is a sequence of steps, each recorded in etcd before and after it runs:
``keys`` (the job's coordination values), ``volume`` (the job directory), ``secrets``,
``learners`` (one controller per rank), ``helper``, then ``complete``. If a step fails, or
a guardian finds steps recorded without ``complete`` (its predecessor died mid-deploy),
it rolls back everything labelled with the job id and starts over, up to
``deploy_attempts`` times, then marks the job FAILED with the reason.

Once deployed it watches the learners' statuses in etcd and moves the job record along
``DOWNLOADING → PROCESSING → STORING → COMPLETED`` as the slowest learner does. It
restarts a learner whose command failed up to the manifest's ``max_learner_restarts``
(then fails the job with the exit code and the learner's last log lines), restarts a
learner whose controller died (that is the platform's failure, not the job's: the new
controller re-adopts the running command), and carries out halt and delete requests
from the job's control key. Every end (completed, failed, halted, deleted) goes the same
way: stop what runs, write the record, erase the job's keys from etcd.

Every record write is a compare-and-set on the record's version (the fencing token); a
lost race re-reads the record and decides again, so the loop is level-triggered and
safe to restart at any point.

What a running job costs (issue #16, benchmarks/RESULTS.md): a guardian process watches
the job's prefix (`PrefixWatch`: every change, none lost across a broken stream) and reads
etcd only after a change there, or every `safety_poll_s` (10 s). Between them it sleeps
while every controller holding a status key is a child whose exit wakes it (its
reaper's `on_exit`: `exit_wakes`, `quiet_wait_s`); otherwise it wakes every `poll_s`
(0.5 s) for what etcd does not say at once: whether those controllers still run (a /proc
read each, no request: a dead one's lease is revoked and the full round follows). A halt
(the control key) and SIGTERM wake it either way; once the watch shows its own guardian
key deleted (its lease expired) it polls again until `lease.lost` says so. A job whose
learners are still starting, or an elastic one, is looked at fully every `poll_s` as
before (start-up deadlines and stragglers are counted in time, not in etcd changes). In
a guardian host (services/guardian/host.py) every step is a full round: the host steps a
guardian on a change of its job and otherwise every `--poll` seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contract import etcd_keys, procs
from contract.etcd import Entry, EtcdClient, Lease
from contract.etcd_watch import Change, PrefixWatch
from contract.procs import free_port
from contract.status import (
    FINAL_STATUSES,
    HAPPY_PATH,
    PREEMPTION_EXIT_CODES,
    ExitCode,
    LearnerStatus,
)
from services.backends.api import Backend, BackendError, JobSpec, RenewalUnsupported
from services.guardian.config import GuardianConfig
from services.guardian.elastic import ElasticScaler
from services.guardian.pipeline import PipelineFailover
from services.guardian.replacement import ReplacementPlanner, SchedulerAccess
from services.manifest import Manifest
from services.security.api import TlsError
from services.security.tls import InternalTls, renewal_due
from services.store import states
from services.store.errors import JobNotFound, StaleToken
from services.store.job_secrets import JobSecrets
from services.store.jobs import JobRecord, JobsRepository
from services.store.preemption_stats import PreemptionStatsRepository

log = logging.getLogger("rhizome.guardian")

# What the LCM reads from a guardian's exit (services/guardian/__main__.py lists them).
EXIT_DONE = ExitCode.OK
EXIT_ALREADY_GUARDED = ExitCode.FATAL  # another guardian holds the job: do not restart
EXIT_LEASE_LOST = ExitCode.EVICTED
EXIT_TERMINATED = ExitCode.PREEMPTED

STEPS = ("keys", "volume", "secrets", "learners", "helper")
COMPLETE = "complete"
RESTARTS = "restarts"
# rank -> restarts after preemptions (a command ended by SIGTERM or SIGKILL): counted apart
# from RESTARTS (the command failed by itself), bounded by the manifest's max_preemptions.
PREEMPTIONS = "preemptions"
# A failed certificate renewal is tried again after this long: the certificate is renewed
# from half its validity (12 h of a 24 h one), so there are hundreds of tries before it
# expires, and a failing backend is not asked every round.
RENEWAL_RETRY_S = 60.0
# A guardian process's full monitoring round without any change under the job's prefix
# (a safety poll behind the watch: PrefixWatch delivers every change, re-watching from the
# last revision after a broken stream, so this only bounds what a lost change could cost).
SAFETY_POLL_S = 10.0
# How far each learner status is along the happy path (the job follows the slowest).
_LEVEL = {status: level for level, status in enumerate(HAPPY_PATH)}
_JOB_LEVEL = {
    states.PENDING: 0,
    states.DEPLOYING: 0,
    states.RESUMING: 0,
    states.DOWNLOADING: 1,
    states.PROCESSING: 2,
    states.RECOVERING: 2,
    states.RESCALING: 2,
    states.STORING: 3,
}
_HAPPY = (states.DOWNLOADING, states.PROCESSING, states.STORING)
_LEARNER_FINAL = FINAL_STATUSES


def _rank_of(key: str) -> int:
    """The rank in a learner status key (`.../learners/<rank>/status`); -1 if none."""
    part = key.rstrip("/").split("/")[-2:-1]
    return int(part[0]) if part and part[0].isdigit() else -1


def preemption_message(rank: int, code: int, count: int, spec: JobSpec) -> str:
    """The history line of a learner's preemption: what ended it, and that it is restarted
    without counting against max_learner_restarts."""
    how = (
        "SIGTERM: its node's preemption notice (a spot reclaim, the scheduler, an injector)"
        if code in (int(ExitCode.PREEMPTED), -15)
        else "SIGKILL: at the end of its notice, or its node went away without one"
    )
    return (
        f"learner {rank} preempted (exit {code}, {how}); restarted, preemption {count} of "
        f"at most {spec.manifest.max_preemptions} (not counted against max_learner_restarts)"
    )


def job_over(jobs: JobsRepository, job_id: str) -> bool:
    """Whether job `job_id` is over for good (or gone): its backend holdings may go."""
    try:
        return states.is_terminal(jobs.get(job_id).status)
    except JobNotFound:
        return True


class DeployStepFailed(RuntimeError):
    """A deploy step failed (the message names the step); the guardian rolls back."""


class Guardian:
    def __init__(
        self,
        config: GuardianConfig,
        etcd: EtcdClient,
        jobs: JobsRepository,
        backend: Backend,
        stats: PreemptionStatsRepository | None = None,
    ) -> None:
        self.config = config
        self.stats = stats
        # rank -> (instance type, zone, monotonic time it was preempted): the restart that
        # follows is recorded as a reallocation once the learner processes again.
        self.preempted: dict[int, tuple[str, str, float]] = {}
        self.job_id = config.job_id
        self.etcd = etcd
        self.jobs = jobs
        self.backend = backend
        self.lease: Lease | None = None
        self.terminate = threading.Event()
        self.wake = threading.Event()
        self.handles: dict[int, int] = {}
        self._renewal_refused = False  # the backend cannot renew certificates: stop asking
        self._renewal_retry_at = 0.0  # after a failed renewal: when to try again
        self.started_at: dict[int, float] = {}
        self.platform_restarts = 0
        self.pipeline = PipelineFailover(self)
        # asks the scheduler where a lost pipeline learner's replacement runs; the mTLS
        # client certificate is the job's (the same CA signs it; the token authorizes)
        self.replacements = ReplacementPlanner(
            SchedulerAccess(config.scheduler_address, config.scheduler_token, config.tds_tls)
            if config.scheduler_address
            else None
        )
        self.elastic = ElasticScaler(self)  # scale requests of an elastic job
        # The deployed job being monitored and its learners' spec, kept between steps;
        # None until the deploy is complete, and after a lost race (re-read then).
        self.watching: tuple[JobRecord, JobSpec] | None = None
        # The longest wait between two steps without a change: a quick step (the
        # controllers' liveness) while the job is quiet, else a full monitoring round.
        self.poll_s = 0.5
        # Quiet steps (`_quiet_step`) only where this guardian's own watch sets `changed`
        # (a process: `run`); stepped by a host, every step is a full round.
        self.quiet_steps = False
        self.safety_poll_s = SAFETY_POLL_S
        # Whether the exit of process `pid` wakes this guardian at once (`wake`): a
        # guardian process's reaper does so for the controllers it started
        # (`__main__.WaitingReaper`); None where nothing does (a host, the tests' own).
        self.exit_wakes: Callable[[int], bool] | None = None
        self.key_deleted = False  # our guardian key's deletion came through the watch
        self.changed = threading.Event()  # something under the job's prefix changed
        self._full_at = -1e9  # when the last full monitoring round began (monotonic)
        # What the last full round saw: each running learner's status entry (its
        # controller's pid and start), and whether it may be trusted until a change
        # (every learner has a status; the job is not elastic).
        self._seen: dict[int, Entry] = {}
        self._settled = False

    # -- ownership ------------------------------------------------------------------------
    def acquire(self, shared: Lease | None = None, **holder: Any) -> bool:
        """Take the job's guardian key (create if absent, under our lease). A guardian
        host passes its own lease (`shared`, kept alive by the host) and what names it
        (`holder`: its id), for every job it runs."""
        self.lease = shared or self.etcd.grant(self.config.lease_ttl_s).keep_alive()
        key = etcd_keys.guardian_lease(self.job_id)
        me = procs.ProcRef.of(os.getpid())
        value = {
            "pid": os.getpid(),
            "start": me.start if me else 0,
            "lease": self.lease.id,
            **holder,
        }
        deadline = time.monotonic() + self.config.lease_ttl_s + 3
        while time.monotonic() < deadline:
            if self.etcd.create(key, value, self.lease):
                return True
            held = self.etcd.get(key)
            if held is None:
                continue
            holder = held.value if isinstance(held.value, dict) else {}
            if procs.ref_alive(holder.get("pid"), holder.get("start")):
                return False
            self.etcd.revoke(held.lease)  # the holder is dead: do not wait for its TTL
            time.sleep(0.05)
        return False

    def run(self) -> int:
        if not self.acquire():
            log.info("job %s already has a live guardian", self.job_id)
            if self.lease:
                self.lease.revoke()
            return EXIT_ALREADY_GUARDED
        watch = PrefixWatch(self.etcd, etcd_keys.job_prefix(self.job_id), self._on_change)
        try:
            watch.start()
            self.quiet_steps = True
            self.backend.release_ended(self.config.jobs_dir, self.config.objects_dir, self._ended)
            return self._run()
        finally:
            watch.stop()
            if self.lease:
                self.lease.revoke()

    def _on_change(self, changes: list[Change], full: bool) -> None:
        """The watch's thread: a change under the job's prefix (or a fresh read of it)."""
        mine = etcd_keys.guardian_lease(self.job_id)
        if any(c.deleted and c.key == mine for c in changes):
            # Our lease expired (or we erased the job's keys): `lease.lost` follows at
            # the keep-alive's next refresh, which wakes nobody, so poll until it does.
            self.key_deleted = True
        self.changed.set()
        self.wake.set()

    def _run(self) -> int:
        """The process-per-job driver: a step, then (once deployed) a wait for a change
        under the job's prefix, or `poll_s` at most (a quick step while nothing changed)."""
        while True:
            done = self.step()
            if done is not None:
                return done
            if self.watching is not None:
                self.wake.wait(self.quiet_wait_s())
                self.wake.clear()

    def quiet_wait_s(self) -> float:
        """How long `_run` waits for a change before the next step. `poll_s` while a
        quick step has something to look at that no event reports: a controller holding a
        status key that is not our child (adopted from an earlier guardian, or on another
        backend), whose death only its lease's expiry (TTL) would say, or our own lease
        lost once our guardian key's deletion was seen (`lease.lost` is set by the
        keep-alive thread, which wakes nobody). When every such controller's exit wakes us
        (our reaper's children), so does everything else a quick step looks at (a change
        under the job's prefix: the watch; SIGTERM: its handler): then the wait lasts until
        the safety poll's full round is due (issue #16: the quick steps woke the guardian
        twice a second on the cores the job's workers use)."""
        exit_wakes = self.exit_wakes
        if not self.quiet_steps or not self._settled or exit_wakes is None or self.key_deleted:
            return self.poll_s
        for entry in self._seen.values():
            value = entry.value if isinstance(entry.value, dict) else {}
            pid = value.get("pid")
            if not isinstance(pid, int) or not exit_wakes(pid):
                return self.poll_s
        due = self.safety_poll_s - (time.monotonic() - self._full_at)
        return max(self.poll_s, due)

    def step(self) -> int | None:
        """One pass of the guardian: read the job, deploy it (all of a deploy attempt) or
        look at its learners once and act. Returns the guardian's exit code once the job
        has left its hands, else None: call it again (after a change, or a poll period).
        Level-triggered: any pass may be the first one of a new guardian."""
        if self.terminate.is_set():
            return self.detach()
        if self.lease and self.lease.lost.is_set():
            return EXIT_LEASE_LOST
        try:
            if self.watching is None:
                try:
                    job = self.jobs.get(self.job_id)
                except JobNotFound:
                    self.backend.rollback(self.job_id, self.job_dir)
                    self.release()
                    self.erase()
                    return EXIT_DONE
                if job.status in states.TERMINAL_STATES or job.status in (
                    states.HALTED,
                    states.QUEUED,
                ):
                    self.backend.rollback(self.job_id, self.job_dir)
                    if job.status in states.TERMINAL_STATES:
                        self.release()
                    self.erase()
                    return EXIT_DONE
                complete = self.etcd.get(etcd_keys.deploy_step(self.job_id, COMPLETE))
                if complete is None:
                    return self.deploy(job)
                spec = self.spec(
                    job, int(complete.value["generation"]), int(complete.value["master_port"])
                )
                self.watching = (job, spec)
            if self._quiet_step():
                return None
            started = dict(self.started_at)
            outcome = self.monitor()
            if self.started_at != started:
                self._settled = False  # a learner was (re)started: its start is timed
            return outcome
        except (StaleToken, states.IllegalTransition) as exc:
            log.info("job %s changed under us (%s); deciding again", self.job_id, exc)
            self.watching = None  # the next step reads the record again
            return None

    # -- deploy ---------------------------------------------------------------------------
    @property
    def job_dir(self) -> str:
        return str(self.config.jobs_dir / self.job_id)

    def spec(self, job: JobRecord, generation: int, master_port: int) -> JobSpec:
        manifest = job.spec
        if job.secrets:  # the data-store credentials the record only refers to
            resolved = JobSecrets.in_data_dir(self.config.data_dir).resolve(
                job.job_id, job.manifest
            )
            manifest = Manifest.from_document(resolved)
        grace_s = manifest.checkpoint.grace_s
        return JobSpec(
            job_id=job.job_id,
            command=manifest.command,
            learners=int(job.resources["learners"]),  # the job's current size
            job_dir=self.job_dir,
            checkpoint_dir=str(Path(self.job_dir) / "checkpoints"),
            result_store=str(self.config.objects_dir / "results" / job.job_id),
            etcd_url=self.config.etcd_url,
            generation=generation,
            model_zip=str(self.config.objects_dir / job.model_path) if job.model_path else "",
            manifest=manifest,
            placement=dict(job.placement or {}),
            gpus_per_learner=float(job.resources["gpus"]),
            memory_mb=float(job.resources["memory_mb"]),
            master_port=master_port,
            tds_address=self.config.tds_address,
            tds_token=self.config.tds_token,
            tds_tls=self.config.tds_tls,
            etcd_credentials=self.config.etcd_credentials,
            grace_s=self.config.learner_grace_s if grace_s is None else grace_s,
            platform_env=self.preemption_env(manifest),
            learner_lease_ttl_s=self.config.learner_lease_ttl_s,
        )

    # -- what the platform learns about preemptions (ARCHITECTURE §6) ---------------------
    @staticmethod
    def site(manifest: Manifest) -> tuple[str, str]:
        """The instance type and zone preemption statistics are kept under."""
        zone = manifest.zones[0] if manifest.zones else "local"
        return manifest.instance_type or "local", zone

    def preemption_env(self, manifest: Manifest) -> dict[str, str]:
        """RHIZOME_MTTP_S and RHIZOME_RESTART_S from the platform's current estimates."""
        if self.stats is None:
            return {}
        try:
            return self.stats.estimate(*self.site(manifest)).learner_env()
        except Exception as exc:  # the prior in the learner is a fine fallback
            log.warning("job %s: no preemption estimate (%s)", self.job_id, exc)
            return {}

    def record_preemption(self, spec: JobSpec, rank: int, code: int, now: float) -> None:
        """A learner killed by a signal (SIGTERM after a notice, or SIGKILL) counts as a
        preemption of its node: its lifetime feeds the platform's MTTP."""
        if self.stats is None or code not in PREEMPTION_EXIT_CODES:
            return
        instance_type, zone = self.site(spec.manifest)
        lifetime = max(0.0, now - self.started_at.get(rank, now))
        try:
            self.stats.record_preemption(instance_type, zone, lifetime, job_id=self.job_id)
        except Exception as exc:
            log.warning("job %s: could not record a preemption (%s)", self.job_id, exc)
            return
        self.preempted[rank] = (instance_type, zone, now)

    def record_reallocation(self, rank: int, status: LearnerStatus, now: float) -> None:
        """The preempted learner processes again: the wait feeds the restart time R."""
        if self.stats is None or rank not in self.preempted or status != LearnerStatus.PROCESSING:
            return
        instance_type, zone, since = self.preempted.pop(rank)
        try:
            self.stats.record_reallocation(instance_type, zone, now - since, job_id=self.job_id)
        except Exception as exc:
            log.warning("job %s: could not record a reallocation (%s)", self.job_id, exc)

    def control(self, read: dict[str, Entry] | None = None) -> dict[str, Any]:
        """The job's control key (halt, delete, scale): from `read` (`round_read`) if
        given, else read now."""
        key = etcd_keys.control(self.job_id)
        entry = read.get(key) if read is not None else self.etcd.get(key)
        return entry.value if entry is not None and isinstance(entry.value, dict) else {}

    def round_read(self, spec: JobSpec) -> dict[str, Entry] | None:
        """What a monitoring round of a job that is neither elastic nor a pipeline reads
        of etcd (the control key, the learners' statuses, the restart and preemption
        counts), in one call: a transaction of their reads (`EtcdClient.get_many`),
        where they were four calls (issue #18: a settled hosted job's safety round every
        30 s, the part of a host's steady cost that grows with its jobs; a round with
        four calls cost 2.5-3x the CPU of one with one). The same keys, fresh from etcd
        at one revision. None for an elastic or pipeline job: between those reads its
        round writes what the later ones read (`ElasticScaler.apply`), so the control
        key is read apart, as before."""
        if spec.manifest.elastic is not None or spec.manifest.pipeline is not None:
            return None
        return self.etcd.get_many(
            keys=(
                etcd_keys.control(self.job_id),
                etcd_keys.deploy_step(self.job_id, RESTARTS),
                etcd_keys.deploy_step(self.job_id, PREEMPTIONS),
            ),
            prefixes=(etcd_keys.learner_prefix(self.job_id),),
        )

    def _fault(self, step: str, attempt: int) -> None:
        name, _, upto = self.config.fail_step.partition(":")
        if name == step and attempt < int(upto or 1_000_000):
            raise DeployStepFailed(f"step {step} failed (injected fault, attempt {attempt})")

    def deploy(self, job: JobRecord) -> int | None:
        action = self.control().get("action")
        if action in ("halt", "delete"):
            return self.finish(
                states.HALTED if action == "halt" else states.DELETED, self.control_reason()
            )
        recorded = self.etcd.get_prefix(etcd_keys.deploy_prefix(self.job_id))
        if recorded:
            # Steps without `complete`: a guardian died mid-deploy. Undo all, count it.
            log.info(
                "job %s: found a partial deploy (%s); rolling back", self.job_id, sorted(recorded)
            )
            self.rollback()
            job = self.count_attempt(job, "the guardian restarted during the deploy")
            if job.status == states.FAILED:
                return EXIT_DONE
        if job.status == states.PENDING:
            job = self.jobs.transition(
                self.job_id, states.DEPLOYING, "deploying", expect_version=job.version
            )
        generation = self.etcd.revision()
        attempt = job.attempts
        try:
            # In the try: credentials that cannot be found fail this attempt, naming why.
            spec = self.spec(job, generation, free_port())
            for step in STEPS:
                if self.control().get("action") in ("halt", "delete"):
                    self.rollback()
                    return None  # the next round sees the request and ends the job
                key = etcd_keys.deploy_step(self.job_id, step)
                self.etcd.put(
                    key, {"state": "started", "generation": generation, "time": time.time()}
                )
                if self.config.step_delay_s:
                    time.sleep(self.config.step_delay_s)
                self._fault(step, attempt)
                result = self.run_step(step, spec)
                self.etcd.put(
                    key,
                    {"state": "done", "generation": generation, "time": time.time(), **result},
                )
            self.etcd.put(
                etcd_keys.deploy_step(self.job_id, COMPLETE),
                {"generation": generation, "master_port": spec.master_port, "time": time.time()},
            )
            log.info("job %s deployed (generation %d)", self.job_id, generation)
            return None
        except Exception as exc:
            log.warning("job %s: deploy attempt %d failed: %s", self.job_id, attempt + 1, exc)
            self.rollback()
            job = self.count_attempt(job, str(exc))
            if job.status == states.FAILED:
                return EXIT_DONE
            time.sleep(min(2.0, 0.2 * job.attempts))
            return None

    def run_step(self, step: str, spec: JobSpec) -> dict[str, Any]:
        if step == "keys":
            self.etcd.put(
                etcd_keys.runtime_config(self.job_id),
                self.runtime_config(spec),
            )
            return {}
        if step == "volume":
            self.backend.prepare_volume(spec)
            return {"job_dir": spec.job_dir}
        if step == "secrets":
            self.backend.write_secrets(spec)
            return {}
        if step == "learners":
            for rank in range(spec.learners):
                # a pipeline job's standbys (ranks beyond its workers) start with tickets
                self.handles[rank] = self.pipeline.start_learner(spec, rank, 0)
                self.started_at[rank] = time.monotonic()
            return {"handles": {str(r): h for r, h in self.handles.items()}}
        if step == "helper":
            self.backend.start_helper(spec)
            return {}
        raise DeployStepFailed(f"unknown deploy step {step!r}")

    @staticmethod
    def runtime_config(spec: JobSpec) -> dict[str, Any]:
        """What `runtime/config` publishes: the world (torch.distributed's env:// names for
        any job) and, for a pipeline job, its shape and where its rendezvous store is
        (the platform's etcd, under `runtime/store/`: no process hosts it)."""
        config: dict[str, Any] = {
            "world_size": spec.learners,
            "master_addr": "127.0.0.1",
            "master_port": spec.master_port,
            "generation": spec.generation,
        }
        pipe = spec.manifest.pipeline
        if pipe is not None:
            config.update(
                stages=pipe.stages,
                pipelines=pipe.pipelines,
                rendezvous="etcd",
                store_prefix=etcd_keys.runtime_store_prefix(spec.job_id),
            )
        return config

    def count_attempt(self, job: JobRecord, reason: str) -> JobRecord:
        attempts = job.attempts + 1
        job = self.jobs.update_fields(self.job_id, attempts=attempts)
        if attempts >= self.config.deploy_attempts:
            self.finish(
                states.FAILED,
                f"deploy failed after {attempts} attempts: {reason}",
            )
            return self.jobs.get(self.job_id)
        return job

    def rollback(self) -> None:
        """Undo a deploy: everything labelled with the job id, and its deploy keys."""
        self.backend.rollback(self.job_id, self.job_dir)
        for prefix in (
            etcd_keys.deploy_prefix(self.job_id),
            etcd_keys.learner_prefix(self.job_id),
            etcd_keys.runtime_prefix(self.job_id),
        ):
            self.etcd.delete_prefix(prefix)
        self.handles.clear()
        self.started_at.clear()

    # -- monitor -------------------------------------------------------------------------------
    def _quiet_step(self) -> bool:
        """True when this step needs no etcd read: nothing changed under the job's prefix
        since the last full round, which saw every learner with a status, the safety poll
        is not due, and every controller holding a status key still runs (a /proc read on
        the local backend). A dead one's lease is revoked here, as the full round would,
        and the full round follows at once (False)."""
        if (
            not self.quiet_steps
            or not self._settled
            or self.changed.is_set()
            or time.monotonic() - self._full_at >= self.safety_poll_s
        ):
            return False
        for rank, entry in self._seen.items():
            value = entry.value if isinstance(entry.value, dict) else {}
            if not self.backend.controller_alive(self.job_id, rank, value):
                self.etcd.revoke(entry.lease)  # its controller died: free the rank now
                return False
        return True

    def monitor(self) -> int | None:
        """One look at the deployed job's learners (`self.watching`), and what follows:
        restarts, the record moved along, an end."""
        assert self.watching is not None
        job, spec = self.watching
        # Cleared before the first read: a change from here on is seen by the next step.
        self.changed.clear()
        self._full_at = time.monotonic()
        self._settled = False
        max_restarts = job.spec.max_learner_restarts
        try:
            # The helper (docker: the log collector) of a job we took over, or one
            # that died: started again; a no-op while it runs.
            self.backend.start_helper(spec)
        except BackendError as exc:
            log.warning("job %s: the helper cannot start: %s", self.job_id, exc)
        self.renew_job_certificate(spec)
        read = self.round_read(spec)
        action = self.control(read).get("action")
        if action == "halt":
            return self.halt(spec)
        if action == "delete":
            self.backend.stop_learners(self.job_id, grace_s=2.0)
            return self.finish(states.DELETED, self.control_reason())
        if spec.manifest.elastic is not None:
            job, spec = self.elastic.apply(job, spec)
            self.watching = (job, spec)
        statuses = self.learner_statuses(spec, max_restarts, read)
        if isinstance(statuses, int):
            return statuses
        lost: dict[str, dict[str, Any]] = {}
        if spec.manifest.pipeline is not None:
            outcome = self.pipeline.losses(job, spec, statuses)
            if isinstance(outcome, int):
                return outcome
            job, lost = outcome
            self.watching = (job, spec)
            statuses = {r: s for r, s in statuses.items() if str(r) not in lost}
            if not statuses:
                restarted = self.pipeline.fatal(
                    job, spec, {"fatal": "every learner was lost"}, -1, ExitCode.FATAL
                )
                if isinstance(restarted, int):
                    return restarted
                job, lost = restarted
                self.watching = (job, spec)
                return None
        job = self.advance(job, statuses)
        self.watching = (job, spec)
        if all(s == LearnerStatus.COMPLETED for s in statuses.values()):
            message = "every learner finished"
            if lost:
                ranks = sorted(lost, key=int)
                message = (
                    f"every surviving learner finished (learner{'s' * (len(ranks) > 1)} "
                    f"{', '.join(ranks)} preempted; the runtime failed over)"
                )
            return self.finish(states.COMPLETED, message, exit_code=0)
        return None

    def renew_job_certificate(self, spec: JobSpec) -> None:
        """Past half its validity, the job's TDS client certificate is re-issued and handed
        to the running learners (`Backend.renew_tls`); learners started later get it in
        their spec. A backend that cannot renew at all is told once, and logged; a failed
        attempt (the cluster's API away, a full disk) is tried again a minute later, so
        one bad moment in the certificate's second half does not end the job's logs when
        it expires."""
        if not self.config.tds_tls_dir or not spec.tds_tls or self._renewal_refused:
            return
        if not renewal_due(spec.tds_tls) or time.monotonic() < self._renewal_retry_at:
            return
        try:
            fresh = InternalTls(Path(self.config.tds_tls_dir)).job_credentials(self.job_id)
            self.backend.renew_tls(spec, fresh)
        except RenewalUnsupported as exc:
            self._renewal_refused = True
            log.warning("job %s: cannot renew its TDS certificate: %s", self.job_id, exc)
            return
        except (TlsError, BackendError, OSError) as exc:
            self._renewal_retry_at = time.monotonic() + RENEWAL_RETRY_S
            log.warning(
                "job %s: renewing its TDS certificate failed (trying again in %.0f s): %s",
                self.job_id,
                RENEWAL_RETRY_S,
                exc,
            )
            return
        spec.tds_tls = self.config.tds_tls = fresh
        log.info("job %s: renewed its learners' TDS certificate", self.job_id)

    def learner_statuses(
        self, spec: JobSpec, max_restarts: int, read: dict[str, Entry] | None = None
    ) -> dict[int, LearnerStatus] | int:
        """Each learner's status, acting on what it says (a controller to start again, a
        failed learner's restart or the job's failure); from `read` (`round_read`) if
        given, else read now."""
        restarts_key = etcd_keys.deploy_step(self.job_id, RESTARTS)
        preemptions_key = etcd_keys.deploy_step(self.job_id, PREEMPTIONS)
        if read is None:
            read = self.etcd.get_many(
                keys=(restarts_key, preemptions_key),
                prefixes=(etcd_keys.learner_prefix(self.job_id),),
            )
        restarts_entry = read.get(restarts_key)
        restarts: dict[str, int] = dict(restarts_entry.value) if restarts_entry else {}
        preempted_entry = read.get(preemptions_key)
        preemptions: dict[str, int] = dict(preempted_entry.value) if preempted_entry else {}
        statuses: dict[int, LearnerStatus] = {}
        now = time.monotonic()
        seen: dict[int, Entry] = {}
        settled = spec.manifest.elastic is None
        for rank in range(spec.learners):
            entry = read.get(etcd_keys.learner_status(self.job_id, rank))
            value = entry.value if entry is not None and isinstance(entry.value, dict) else {}
            if entry is None:
                settled = False  # its controller starts: the start grace is counted in time
                handle = self.handles.get(rank)
                exited = handle is not None and self.backend.learner_exited(handle) is not None
                waited = now - self.started_at.get(rank, -1e9) > self.config.start_grace_s
                if handle is None or exited or waited:
                    self.platform_restarts += 1
                    if self.platform_restarts > self.config.platform_restarts:
                        # The backend may know why (a pod stuck Pending, an image that
                        # cannot be pulled): the reason belongs in the job's message.
                        note = self.backend.exit_note(self.job_id, rank)
                        return self.finish(
                            states.FAILED,
                            f"learner {rank}'s controller died {self.platform_restarts} times"
                            + (f" ({note})" if note else ""),
                        )
                    log.info("job %s: (re)starting the controller of learner %d", self.job_id, rank)
                    incarnation = int(restarts.get(str(rank), 0)) + int(
                        preemptions.get(str(rank), 0)
                    )
                    # a pipeline learner's incarnation and ticket are the pipeline's own
                    self.handles[rank] = self.pipeline.restart_controller(spec, rank, incarnation)
                    self.started_at[rank] = now
                statuses[rank] = LearnerStatus.STARTING
            elif entry.lease:
                if not self.backend.controller_alive(self.job_id, rank, value):
                    self.etcd.revoke(entry.lease)  # its controller died: free the rank now
                    self.wake.set()
                    settled = False
                else:
                    seen[rank] = entry
                statuses[rank] = LearnerStatus.parse(value.get("status"), LearnerStatus.STARTING)
            elif value.get("status") == LearnerStatus.FAILED and spec.manifest.pipeline:
                # Not restarted: the runtime fails over without it (PipelineFailover.losses).
                statuses[rank] = LearnerStatus.FAILED
            elif value.get("status") == LearnerStatus.FAILED:
                done = int(restarts.get(str(rank), 0))
                lost = int(preemptions.get(str(rank), 0))
                code = int(value.get("exit_code") or 1)
                if code in PREEMPTION_EXIT_CODES and not self.backend.out_of_memory(
                    self.job_id, rank
                ):
                    # The node was taken away: not the user's code failing, so it does not
                    # count against max_learner_restarts. (A kill for memory exits 137 too,
                    # but is the job's own failure: the backend tells them apart.)
                    if lost >= spec.manifest.max_preemptions:
                        limit = spec.manifest.max_preemptions
                        return self.fail_learner(
                            rank, code, done, f"preempted {lost + 1} times; max_preemptions {limit}"
                        )
                    self.record_preemption(spec, rank, code, now)
                    preemptions[str(rank)] = lost = lost + 1
                    self.etcd.put(etcd_keys.deploy_step(self.job_id, PREEMPTIONS), preemptions)
                    self.jobs.note(self.job_id, preemption_message(rank, code, lost, spec))
                else:
                    if done >= max_restarts:
                        return self.fail_learner(rank, code, done)
                    restarts[str(rank)] = done = done + 1
                    self.etcd.put(etcd_keys.deploy_step(self.job_id, RESTARTS), restarts)
                self.etcd.delete_if(entry.key, entry.mod_revision)
                log.info(
                    "job %s: learner %d exited %d; restart %d", self.job_id, rank, code, done + lost
                )
                self.handles[rank] = self.backend.start_learner(spec, rank, done + lost)
                self.started_at[rank] = now
                statuses[rank] = LearnerStatus.STARTING
            else:
                # a final status: COMPLETED or HALTED (FAILED was handled above)
                statuses[rank] = LearnerStatus.parse(value.get("status"), LearnerStatus.STARTING)
            self.record_reallocation(rank, statuses[rank], now)
        self._seen, self._settled = seen, settled
        return statuses

    def advance(self, job: JobRecord, statuses: dict[int, LearnerStatus]) -> JobRecord:
        """Move the record along the happy path as far as the slowest learner is."""
        slowest = min((_LEVEL.get(s, 0) for s in statuses.values()), default=0)
        while True:
            level = _JOB_LEVEL.get(job.status)
            if level is None or level >= min(slowest, 3):
                return job
            target = (
                _HAPPY[level]
                if job.status not in (states.RECOVERING, states.RESCALING)
                else states.PROCESSING
            )
            job = self.jobs.transition(
                self.job_id, target, f"learners are {target}", expect_version=job.version
            )

    def halt(self, spec: JobSpec) -> int | None:
        """Learners save and stop (they watch the same control key: SIGTERM, the grace,
        then SIGKILL); then HALTED. Bounded: whatever still runs after the grace (and a
        margin) is stopped here, and the history names the learners that were killed
        rather than saving and leaving. (A guardian host does not wait here: its
        HostedGuardian asks `halt_busy` once a step, returning None until `halt_end`.)"""
        deadline = time.monotonic() + spec.grace_s + 5
        busy: list[int] = []
        while time.monotonic() < deadline:
            busy = self.halt_busy()
            if not busy:
                break
            self.wake.wait(0.2)
            self.wake.clear()
        return self.halt_end(spec, busy)

    def halt_busy(self) -> list[int]:
        """The ranks whose controllers still run during a halt."""
        entries = self.etcd.get_prefix(etcd_keys.learner_prefix(self.job_id))
        return [
            _rank_of(e.key)
            for e in entries.values()
            if e.lease
            and isinstance(e.value, dict)
            and self.backend.controller_alive(self.job_id, _rank_of(e.key), e.value)
        ]

    def halt_end(self, spec: JobSpec, busy: list[int]) -> int:
        """The halt's end: stop what still runs (`busy`), then HALTED, naming the killed."""
        entries = self.etcd.get_prefix(etcd_keys.learner_prefix(self.job_id))
        killed = sorted(
            {
                _rank_of(e.key)
                for e in entries.values()
                if isinstance(e.value, dict)
                and e.value.get("status") == LearnerStatus.HALTED.value
                and e.value.get("exit_code") == int(ExitCode.KILLED)
            }
            | set(busy)
        )
        self.backend.stop_learners(self.job_id, grace_s=1.0)
        reason = self.control_reason()
        if killed:
            who = ", ".join(str(r) for r in killed)
            reason += (
                f"; learner{'s' * (len(killed) > 1)} {who} did not stop within its "
                f"{spec.grace_s:g} s grace after SIGTERM and "
                f"{'were' if len(killed) > 1 else 'was'} killed"
            )
        return self.finish(states.HALTED, reason)

    def fail_learner(self, rank: int, code: int, restarts: int, why: str = "") -> int:
        self.backend.stop_learners(self.job_id, grace_s=2.0)
        lines = self.backend.log_tail(self.job_dir, rank)
        note = "; ".join(n for n in (why, self.backend.exit_note(self.job_id, rank)) if n)
        return self.finish(
            states.FAILED,
            f"learner {rank} exited with code {code}"
            + (f" after {restarts} restarts" if restarts else "")
            + (f" ({note})" if note else ""),
            exit_code=code,
            last_log_lines=lines,
        )

    def control_reason(self) -> str:
        control = self.control()
        return str(control.get("reason") or f"{control.get('action', 'stopped')} requested")

    # -- endings -----------------------------------------------------------------------------
    def finish(self, target: str, message: str, **fields: Any) -> int:
        """Stop everything, write the record, erase the job's keys (in that order: the
        record is the truth; keys left by a crash here are garbage the LCM collects)."""
        self.backend.rollback(self.job_id, self.job_dir)
        with contextlib.suppress(states.IllegalTransition):
            current = self.jobs.get(self.job_id)
            if current.status != target:
                self.jobs.transition(self.job_id, target, message, **fields)
        if states.is_terminal(target):  # a halted job resumes with what it held
            self.release()
        self.erase()
        log.info("job %s: %s (%s)", self.job_id, target, message)
        return EXIT_DONE

    def release(self) -> None:
        """The job is over for good: the backend gives back what it held for the job's
        whole life (the local backend's learner uid)."""
        self.backend.release(
            self.job_id, self.job_dir, str(self.config.objects_dir / "results" / self.job_id)
        )

    def _ended(self, job_id: str) -> bool:
        return job_over(self.jobs, job_id)

    def erase(self) -> None:
        """Every key of the job except our own lease key (revoked last, on exit)."""
        for prefix in (
            etcd_keys.deploy_prefix(self.job_id),
            etcd_keys.learner_prefix(self.job_id),
            etcd_keys.runtime_prefix(self.job_id),
        ):
            self.etcd.delete_prefix(prefix)
        self.etcd.delete(etcd_keys.control(self.job_id))

    def detach(self) -> int:
        """The platform is shutting down: learners save and stop, the job stays as it is,
        and the next guardian restarts them where they were."""
        self.backend.stop_learners(self.job_id, grace_s=self.config.learner_grace_s)
        self.backend.stop_helper(self.job_id, self.job_dir)
        return EXIT_TERMINATED
