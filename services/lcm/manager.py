"""The lifecycle manager: keeps exactly one live guardian for every job that needs one.

Level-triggered, like a Kubernetes controller: every round (a short period, or at once
when woken by an RPC, a guardian's exit or a guardian key's change) the leader reads the
active jobs from MongoDB and the job keys from its view of etcd (kept by a watch,
`job_keys.py`), then

1. (no scheduler hosted) places QUEUED jobs on the local machine (`placement.py`);
2. for every active job makes sure a guardian runs: one it started and still supervises,
   or one it finds alive through the job's guardian key (re-adopted after an LCM restart),
   or else a new one — restarted at once the first time, then with exponential backoff;
3. collects garbage: keys of jobs that are no longer active and have no live guardian are
   erased, and anything still running for them is stopped.

A full round reads and looks at every active job; it runs every `full_round_s` (30 s)
and whenever the view of etcd was read afresh. The rounds between (every `poll_s`)
are driven by changes (issue #18: at N=100 the round over every active job, five a
second, was the daemon's largest steady cost per alive job): they read only the records
written since the last round other than by their creation (a new record is QUEUED, which
the LCM has nothing to do for: `JobsRepository.statuses_changed_since`, an indexed range
read on `touched_at`; a `changes_margin_s` overlap with the last round, and once a second
the band of stamps just older than `changes_lookback_s`, for writes that land late:
services/store/stamp_reads.py) and look only at
the jobs whose record or etcd keys changed, plus those something is counted in time
for: a job with no guardian yet (the start window, a backoff, a set-up), a job given to
a host that has not taken it yet, a guardian process that is not our child. A guardian
process or host we started tells of its exit through the reaper (`_guardian_exited`),
and a host an earlier LCM started is looked at once a round (`_check_found_hosts`). The
full round is the safety net behind all of these.

Two LCMs never both act: only the holder of the `leaders/lcm` key (an etcd lease) runs
rounds, and the per-job guardian key makes a second guardian exit at once anyway.
The LCM is a child subreaper: learners and commands orphaned by a dying guardian are
re-parented to it and reaped, so none is left a zombie.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract import etcd_keys, procs
from contract.etcd import Entry, EtcdClient, EtcdCredentials, Lease
from contract.etcd_users import JobUsers, job_etcd_password
from contract.status import ExitCode
from services.backends.api import get_backend
from services.guardian.__main__ import WaitingReaper
from services.guardian.host import HOST_LEASE_TTL_S, assignment, connect_host
from services.lcm.hosting import guardians_per_host_from_env
from services.lcm.job_keys import JobKeys, is_guardian_key
from services.lcm.placement import place_queued_locally
from services.lcm.setup import JobSetups
from services.manifest import Manifest
from services.security.api import (
    GUARDIAN_ETCD_URL_ENV,
    GUARDIAN_MONGODB_URI_ENV,
    GUARDIAN_SERVICE_TOKEN_ENV,
    JOB_ETCD_CREDENTIALS_ENV,
    JOB_TLS_DIR_ENV,
    JOB_TLS_ENV,
    JOB_TOKEN_ENV,
)
from services.store import states
from services.store.errors import JobNotFound, StaleToken, StoreUnavailable
from services.store.job_secrets import JobSecrets
from services.store.jobs import JobsRepository
from services.store.stamp_reads import StampedReads

log = logging.getLogger("rhizome.lcm")

# The longest rest after a slow round (LifecycleManager._loop).
MAX_ROUND_REST_S = 2.0
# How often a round reads and looks at every active job (LcmConfig.full_round_s): the
# safety net behind the change-driven rounds between.
FULL_ROUND_S = 30.0
# How late after its stamp a write may land and still be seen by a change-driven round
# (LcmConfig.changes_lookback_s): a write stamps its `touched_at` before it lands (and
# another machine's clock may be behind ours); one that lands later than this is seen
# by the next full round. A round asks for the records stamped since the last round
# began, less `changes_margin_s` (a write that lands within it is seen by the next
# round); a write that lands later, by the read of the band of stamps that has just
# become older than the look-back, once every `CHANGES_BAND_S` (stamp_reads.py). Every
# round read the whole look-back again before: during a burst of placements each record
# 25 times (5 s, five rounds a second).
CHANGES_LOOKBACK_S = 5.0
CHANGES_MARGIN_S = 0.5
CHANGES_BAND_S = 1.0
# A guardian that exits so found the job guarded by another: restarting it cannot help.
GUARDIAN_ALREADY_GUARDED = ExitCode.FATAL
# The statuses of a job being started: placed, its guardian deploying, its learners
# fetching code (LcmConfig.hosted_start_window counts the hosted ones).
STARTING_STATES = frozenset({states.PENDING, states.DEPLOYING, states.DOWNLOADING})


@dataclass
class LcmConfig:
    data_dir: Path
    etcd_url: str
    mongodb_uri: str
    tds_address: str = ""
    backend: str = "local"
    place_locally: bool = True
    poll_s: float = 0.2
    lease_ttl_s: int = 2
    max_backoff_s: float = 10.0
    stop_timeout_s: float = 15.0
    guardian_env: dict[str, str] = field(default_factory=dict)
    # Issues a job's token for its learners (services/security); handed to its guardian.
    job_token: Callable[[str], str] | None = None
    # Issues a job's mutual-TLS client certificate (`{ca, cert, key}`) when the internal
    # port serves TLS (services/security/tls.py InternalTls); None on plaintext.
    job_tls: Callable[[str], dict[str, str]] | None = None
    # etcd's root user when etcd requires authentication (`rhizome up`): the LCM makes each
    # job's own etcd user with it, for the job's learners. None: no authentication.
    etcd_root: EtcdCredentials | None = field(default=None, repr=False)
    # The internal port's CA directory (with job_tls): guardians renew their job's
    # certificate from it.
    job_tls_dir: Path | None = None
    # The scheduler's internal address and the service credential, handed to guardians
    # (a lost pipeline learner's replacement is placed by ReplaceLearner); "" / None: none.
    scheduler_address: str = ""
    service_token: Callable[[], str] | None = None
    # Guardians per guardian host (`python -m services.guardian.host`, docs/control-plane-
    # scale.md) for jobs that are neither pipeline nor elastic; 0: a process per job.
    # rhizomed passes its --guardians-per-host; unset, $RHIZOME_GUARDIANS_PER_HOST's.
    guardians_per_host: int = field(default_factory=guardians_per_host_from_env)
    # How long a host may take to take an assigned job's guardian key before the LCM
    # gives the job out again.
    host_adopt_grace_s: float = 10.0
    # ...unless it has not yet taken any job given to it after this one: it reads its
    # assignments one at a time, and a burst of set-ups can queue hundreds (each a few ms
    # to take) at once. Then the LCM waits up to this long.
    host_adopt_backlog_s: float = 120.0
    # At most this many hosted jobs are being started at once (set up or given to a host,
    # and not yet PROCESSING); the others wait for a later round. Without it a burst of
    # submits, set up in batches within a minute, started every job's guardian and
    # learners at once: at N=1,000 on two cores etcd stopped answering in time and the
    # daemon and the hosts lost their leases (benchmarks/RESULTS.md, session 10). 0: none.
    hosted_start_window: int = 64
    # A guardian host's etcd lease (services/guardian/host.py HOST_LEASE_TTL_S says why it
    # is longer than a guardian process's `lease_ttl_s`).
    host_lease_ttl_s: int = HOST_LEASE_TTL_S
    # A round over every active job this often; the rounds between look at what changed
    # (the module's docstring). 0: every round is a full one.
    full_round_s: float = FULL_ROUND_S
    changes_lookback_s: float = CHANGES_LOOKBACK_S
    changes_margin_s: float = CHANGES_MARGIN_S


@dataclass
class GuardianHostProcess:
    """A guardian host this LCM gives jobs to: one it started (`proc`: jobs go on its
    standard input), or one an earlier LCM started that this one found running (`conn`:
    its socket, services/guardian/host.py; not our child, so watched by its pid)."""

    host_id: str
    proc: subprocess.Popen[bytes] | None
    ref: procs.ProcRef
    jobs: set[str] = field(default_factory=set)
    conn: socket.socket | None = None

    def give(self, job_id: str, env: dict[str, str]) -> bool:
        """Hand it job `job_id`; False if it is gone (its input is closed)."""
        line = assignment(job_id, env).encode()
        try:
            if self.conn is not None:
                self.conn.sendall(line)
            else:
                assert self.proc is not None and self.proc.stdin is not None
                self.proc.stdin.write(line)
                self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            return False
        self.jobs.add(job_id)
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self.conn is not None:
                self.conn.close()
            elif self.proc is not None and self.proc.stdin is not None:
                self.proc.stdin.close()


@dataclass
class Supervised:
    job_id: str
    ref: procs.ProcRef
    child: bool
    started: float = field(default_factory=time.monotonic)
    host: GuardianHostProcess | None = None  # the job's guardian runs in this host
    taken: bool = False  # its host was seen holding the job's guardian key


class LifecycleManager:
    def __init__(self, config: LcmConfig, jobs: JobsRepository, etcd: EtcdClient) -> None:
        self.config = config
        self.jobs = jobs
        self.etcd = etcd
        self.id = uuid.uuid4().hex[:8]
        self.guardians: dict[str, Supervised] = {}
        self.hosts: list[GuardianHostProcess] = []
        self.failures: dict[str, int] = {}
        self.not_before: dict[str, float] = {}
        # Guardians and guardian hosts are our children, and orphans land on us: reaped by
        # a thread asleep in `waitid` until one exits (the guardian process's reaper), not
        # by a poll every 50 ms, which woke the daemon 20 times a second on a machine whose
        # cores pinned workers train on (issue #16). A guardian's exit still wakes the
        # round at once (`_guardian_exited`).
        self.reaper: procs.Reaper = WaitingReaper()
        self.wake = threading.Event()
        # The keys under the jobs prefix, kept by a watch rather than read every round; a
        # guardian key's change wakes the round (job_keys.py). Started by the first round.
        self._job_keys = JobKeys(etcd, self.wake.set)
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._leader_lease: Lease | None = None
        # Whether this leadership term looked for guardian hosts an earlier LCM started.
        self._hosts_found = False
        self._read_s = 0.0  # how long the last round's reads took (_loop rests as long)
        # Jobs' etcd users, made and removed with one root client (not one per job).
        self._users = (
            JobUsers(config.etcd_url, config.etcd_root) if config.etcd_root is not None else None
        )
        # A hosted job's set-up (its etcd user, token, certificate) and the removal of an
        # ended job's etcd user run on the set-up thread, off the round (done in the round,
        # the set-ups of a burst of submits held every other round's work for minutes), in
        # batches whose auth changes are made back to back: each auth change refuses every
        # etcd client's token (services/lcm/setup.py).
        root = config.etcd_root
        self._setup = JobSetups(
            self._users,
            (lambda job_id: job_etcd_password(root, job_id)) if root is not None else str,
            self._job_env_rest,
        )
        self._setups: dict[str, Future[dict[str, str] | None]] = {}
        self._setup_failures: dict[str, int] = {}
        # Per guardian host, when the latest job it was seen to take was given to it
        # (`_guards`): a job given before that and not taken was dropped.
        self._host_progress: dict[str, float] = {}
        # Hosted jobs being started (hosted_start_window), counted by each round.
        self._starting = 0
        # The active jobs as the last round knew them (id -> status), and whether each may
        # go to a guardian host (neither pipeline nor elastic: its manifest parsed once).
        self._active: dict[str, str] = {}
        self._hostable: dict[str, bool] = {}
        self._full_at = -1e9  # when the last full round read (monotonic)
        # Where the next change-driven round's read of the records starts (wall time).
        self._changes = StampedReads(
            config.changes_lookback_s, config.changes_margin_s, CHANGES_BAND_S
        )
        # Jobs a change-driven round must look at whatever MongoDB and etcd say: their
        # guardian exited, a request for them came (`_mark`).
        self._marked: set[str] = set()
        self.backend = get_backend(config.backend)

    # -- life ------------------------------------------------------------------------------
    def start(self) -> None:
        procs.become_subreaper()
        self.reaper.start()
        self._thread = threading.Thread(target=self._loop, name="lcm", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the rounds and the guardians this LCM runs (they stop their learners and
        leave the jobs as they are; the next LCM starts guardians that carry on)."""
        self._stop.set()
        self.wake.set()
        if self._thread:
            self._thread.join(timeout=5)
        self._setup.close()
        if self._users is not None:
            self._users.close()
        with self._lock:
            running = [g for g in self.guardians.values() if g.ref.alive()]
            running += [
                Supervised(h.host_id, h.ref, child=True) for h in self.hosts if h.ref.alive()
            ]
        for host in self.hosts:
            host.close()
        for g in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(g.ref.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_timeout_s
        while time.monotonic() < deadline and any(g.ref.alive() for g in running):
            time.sleep(0.05)
        for g in running:
            if g.ref.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(g.ref.pid, signal.SIGKILL)
        self.reaper.reap_once()
        self.reaper.stop()
        self._job_keys.stop()
        if self._leader_lease:
            self._leader_lease.revoke()

    def _loop(self) -> None:
        reauthentications, report_at, slow_report_at = 0, 0.0, 0.0
        reported_setups = (0, 0)
        while not self._stop.is_set():
            if time.monotonic() >= report_at:  # the auth-change storm, for benchmarks
                report_at = time.monotonic() + 5.0
                if self.etcd.reauthentications != reauthentications:
                    reauthentications = self.etcd.reauthentications
                    log.info("lcm: etcd re-authentications so far: %d", reauthentications)
                setups = self._setup.stats
                if (setups.setups, setups.removals) != reported_setups:
                    reported_setups = (setups.setups, setups.removals)
                    log.info(
                        "lcm: job set-ups so far: %d (%d failed) and %d etcd user removals "
                        "in %d batches (largest %d); %.1f s in etcd auth changes, %.1f s the rest",
                        setups.setups,
                        setups.failed,
                        setups.removals,
                        setups.batches,
                        setups.largest,
                        setups.users_s,
                        setups.rest_s,
                    )
            started = time.monotonic()
            try:
                if self.is_leader():
                    self.reconcile()
                else:
                    self._hosts_found = False  # whoever leads may start hosts meanwhile
                    self._full_at = -1e9  # and what we knew may be stale: a full round first
            except (StoreUnavailable, OSError) as exc:
                log.warning("lcm round failed, retrying: %s", exc)
            except Exception:
                log.exception("lcm round failed")
            # A round reads every active job and every job key: with a thousand jobs that
            # takes a good part of a second, and rounds woken back to back (a burst of
            # submits, of guardians ending) would keep the daemon's GIL busy reading,
            # starving its API. Rest at least as long as the reading took; a few
            # milliseconds at small N, so nothing changes there.
            took = time.monotonic() - started
            if took > 0.5 and time.monotonic() >= slow_report_at:
                slow_report_at = time.monotonic() + 10.0
                log.info(
                    "lcm: a round took %.2f s, %.2f s of it reading (%d guardians)",
                    took,
                    self._read_s,
                    len(self.guardians),
                )
            if self._read_s > 0.02:  # not the jobs' set-up: that is work, not overhead
                self._stop.wait(min(self._read_s, MAX_ROUND_REST_S))
            self.wake.wait(self.config.poll_s)
            self.wake.clear()

    # -- leadership ----------------------------------------------------------------------------
    def is_leader(self) -> bool:
        lease = self._leader_lease
        if lease is not None and not lease.lost.is_set():
            return True
        lease = self.etcd.grant(self.config.lease_ttl_s)
        me = procs.ProcRef.of(os.getpid())
        value = {
            "id": self.id,
            "pid": os.getpid(),
            "start": me.start if me else 0,
            "lease": lease.id,
        }
        key = etcd_keys.leader("lcm")
        if self.etcd.create(key, value, lease):
            self._leader_lease = lease.keep_alive()
            log.info("lcm %s is the leader", self.id)
            return True
        lease.revoke()
        held = self.etcd.get(key)
        if held is not None and isinstance(held.value, dict):
            holder = held.value
            # A leader on this machine that died: free the key now instead of at its TTL.
            if holder.get("id") != self.id and not procs.ref_alive(
                holder.get("pid"), holder.get("start")
            ):
                self.etcd.revoke(held.lease)
                # The key is free now: take it in this round rather than the next one.
                lease = self.etcd.grant(self.config.lease_ttl_s)
                value["lease"] = lease.id
                if self.etcd.create(key, value, lease):
                    self._leader_lease = lease.keep_alive()
                    log.info("lcm %s is the leader (its predecessor died)", self.id)
                    return True
                lease.revoke()
        return False

    # -- rounds ---------------------------------------------------------------------------------
    def reconcile(self) -> None:
        if self.config.guardians_per_host > 0 and not self._hosts_found:
            self.find_hosts()
            self._hosts_found = True
        self._check_found_hosts()
        if self.config.place_locally:
            place_queued_locally(self.jobs)
        changed = self._job_keys.take_changed() if self._job_keys.started else None
        with self._lock:
            marked, self._marked = self._marked, set()
        due = time.monotonic() - self._full_at >= self.config.full_round_s
        if changed is None or due or not self._job_keys.started:
            self._full_round()
        else:
            self._changed_round(changed | marked)

    def _full_round(self) -> None:
        """Read every active job and every job key; look at each (the safety net)."""
        read_since = time.time()
        reading = time.monotonic()
        # Ids, statuses and manifests only: not the records' histories (manifests_by_status).
        active = self.jobs.manifests_by_status(states.ACTIVE_STATES)
        if self._view_started():
            # This round looks at every job: what changed in etcd until now with it (what
            # changes from here on, the next round looks at, perhaps twice).
            self._job_keys.take_changed()
        keys = self.job_keys()
        self._read_s = time.monotonic() - reading
        self._full_at = reading
        self._changes.reset(read_since)
        self._active = {job_id: status for job_id, status, _ in active}
        self._hostable = {
            job_id: self._hostable[job_id]
            if job_id in self._hostable
            else self._may_be_hosted(manifest)
            for job_id, _, manifest in active
        }
        guardian_keys = {k: e for k, e in keys.items() if is_guardian_key(k)}
        with self._lock:
            guarded = set(self.guardians)
        with_keys = {j for j in map(etcd_keys.job_of, keys) if j}
        self._act(
            list(self._active),
            sorted((guarded | with_keys) - self._active.keys()),
            lambda job_id: guardian_keys.get(etcd_keys.guardian_lease(job_id)),
            with_keys.__contains__,
        )

    def _changed_round(self, changed: set[str]) -> None:
        """Read the records written since the last round; look at the jobs whose record
        or keys changed and at those something is counted in time for."""
        reading = time.monotonic()
        look = set(changed)
        new: list[str] = []
        for job_id, status in self._changes.read(self.jobs.statuses_changed_since):
            known = self._active.get(job_id)
            if status not in states.ACTIVE_STATES:
                if known is not None:  # it ended (or was halted): no longer active
                    del self._active[job_id]
                    self._hostable.pop(job_id, None)
                    look.add(job_id)
            elif known is None:
                new.append(job_id)
            elif known != status:
                self._active[job_id] = status
                look.add(job_id)
        try:
            manifests = self.jobs.manifests_of(new)
        except BaseException:
            # The changes read above are not read again by the next change-driven round:
            # a full one instead.
            self._full_at = -1e9
            raise
        for job_id, status, manifest in manifests:
            if status in states.ACTIVE_STATES:  # not moved on since (else the next round)
                self._active[job_id] = status
                self._hostable[job_id] = self._may_be_hosted(manifest)
                look.add(job_id)
        self._read_s = time.monotonic() - reading
        with self._lock:
            # Counted in time, not told by a change: no guardian yet (waiting for the start
            # window, a backoff, its set-up), given to a host that has not taken it yet,
            # or guarded by a process that is not our child (its exit tells nobody).
            look.update(self._active.keys() - self.guardians.keys())
            look.update(j for j, g in self.guardians.items() if not self._told_of(g))
        look.discard("")
        self._act(
            sorted(j for j in look if j in self._active),
            sorted(j for j in look if j not in self._active),
            lambda job_id: self._job_keys.get(etcd_keys.guardian_lease(job_id)),
            self._job_keys.has_keys,
        )

    @staticmethod
    def _may_be_hosted(manifest: dict[str, Any]) -> bool:
        spec = Manifest.from_document(manifest)
        return spec.pipeline is None and spec.elastic is None

    @staticmethod
    def _told_of(current: Supervised) -> bool:
        """Whether a change tells the LCM when `current` stops guarding its job: a guardian
        process that is our child (the reaper: `_guardian_exited`); a host that holds the
        job's key (its letting go is a key change; its exit, the reaper's or
        `_check_found_hosts`'s word)."""
        return current.taken if current.host is not None else current.child

    def _act(
        self,
        active: list[str],
        inactive: list[str],
        held: Callable[[str], Entry | None],
        has_keys: Callable[[str], bool],
    ) -> None:
        """What a round does for the jobs it looks at: a guardian for each `active` job
        (oldest first); for each of `inactive` (no longer active, or never known), its
        guardian's end taken note of and its leftover keys collected."""
        window = self.config.hosted_start_window
        hosting = self.config.guardians_per_host > 0
        with self._lock:  # ended before it was given out (halted, deleted): not given out
            for job_id in [j for j in self._setups if j not in self._active]:
                del self._setups[job_id]  # its set-up's end (_set_up) finds it gone
            for job_id in [j for j in self._setup_failures if j not in self._active]:
                del self._setup_failures[job_id]
            self._starting = sum(
                1
                for j, status in self._active.items()
                if status in STARTING_STATES and self._started_hosted(j)
            )
        for job_id in active:
            entry = held(job_id)
            hostable = self._hostable.get(job_id, False)
            if (
                hosting
                and hostable
                and window > 0
                and self._starting >= window
                and entry is None
                and job_id not in self.guardians
                and job_id not in self._setups
            ):
                continue  # waits for the start window: nothing to do for it this round
            self.ensure_guardian(job_id, entry, hostable=hostable)
        ended_in_hosts = []
        with self._lock:
            for job_id in [j for j in inactive if j in self.guardians]:
                current = self.guardians[job_id]
                in_host = current.host is not None and current.ref.alive()
                if in_host and held(job_id) is None:
                    # Its guardian in a live host ended the job and let go of it.
                    assert current.host is not None
                    current.host.jobs.discard(job_id)
                    ended_in_hosts.append(job_id)
                elif in_host or current.ref.alive():
                    self._marked.add(job_id)  # still ending: looked at again next round
                    continue
                self.guardians.pop(job_id)
                self.failures.pop(job_id, None)
        for job_id in ended_in_hosts:
            self._job_ended(job_id)
        for job_id in inactive:
            if has_keys(job_id):
                self.collect(job_id, held(job_id))

    def _mark(self, job_id: str) -> None:
        """Have the next round look at job `job_id` (and wake it)."""
        with self._lock:
            self._marked.add(job_id)
        self.wake.set()

    def _check_found_hosts(self) -> None:
        """A host an earlier LCM started is not our child: the reaper does not tell of its
        exit, so each round looks whether it still runs (one /proc read a host, not one a
        job); a dead one's jobs are restarted like those of a host we started."""
        for host in [h for h in self.hosts if h.proc is None and not h.ref.alive()]:
            self._host_exited(host, -1)

    def job_keys(self) -> dict[str, Entry]:
        """Every key under the jobs prefix: the watched view (job_keys.py), or, until its
        watch could be started (etcd away), a read of the prefix as every round made before."""
        if not self._view_started():
            return self.etcd.get_prefix(etcd_keys.jobs_prefix())
        return self._job_keys.snapshot()

    def _view_started(self) -> bool:
        """Whether the watched view of the jobs prefix runs (started now if it can be)."""
        if not self._job_keys.started:
            try:
                self._job_keys.start()
            except StoreUnavailable:
                return False
        return True

    def ensure_guardian(self, job_id: str, held: object, hostable: bool = False) -> None:
        with self._lock:
            current = self.guardians.get(job_id)
            if current is not None and current.ref.alive() and self._guards(current, held):
                return
            if current is not None and current.host is not None and held is None:
                # Its live host let go of it: most likely its guardian just ended the job,
                # after this round read the records. Set up again (its etcd user made
                # again, then removed) only a job that is still active.
                try:
                    if self.jobs.get(job_id).status not in states.ACTIVE_STATES:
                        return
                except JobNotFound:
                    return
            entry = held if held is not None else None
            if entry is not None:
                value = getattr(entry, "value", {})
                if isinstance(value, dict) and procs.ref_alive(
                    value.get("pid"), value.get("start")
                ):
                    ref = procs.ProcRef(int(value["pid"]), int(value["start"]))
                    # In a host we give jobs to: counted in its load, as if we had.
                    host = next(
                        (h for h in self.hosts if h.host_id == value.get("host") and h.ref == ref),
                        None,
                    )
                    if host is not None:
                        host.jobs.add(job_id)
                    self.guardians[job_id] = Supervised(job_id, ref, child=False, host=host)
                    return
                self.etcd.revoke(int(getattr(entry, "lease", 0)))  # its guardian is dead
            if time.monotonic() < self.not_before.get(job_id, 0.0):
                return
            if hostable and self.config.guardians_per_host > 0:
                self.assign(job_id)
            else:
                self.spawn(job_id)

    def _guards(self, current: Supervised, held: object) -> bool:
        """Whether `current` (alive) still guards its job: a process guardian does while
        it lives; a host, once it holds the job's key (or while it may still be taking
        it: it drops a job whose key another live guardian holds, or that it ended)."""
        if current.host is None:
            return True
        value = getattr(held, "value", None)
        host = current.host.host_id
        if isinstance(value, dict) and value.get("pid") == current.ref.pid:
            if not current.taken:  # the host has come this far in its assignments
                current.taken = True
                self._host_progress[host] = max(self._host_progress.get(host, 0.0), current.started)
            return True
        waited = time.monotonic() - current.started
        if waited < self.config.host_adopt_grace_s:
            return True
        behind = self._host_progress.get(host, 0.0) < current.started
        if not current.taken and behind and waited < self.config.host_adopt_backlog_s:
            return True  # its host has not come to it yet: still taking earlier ones
        current.host.jobs.discard(current.job_id)
        return False

    def _started_hosted(self, job_id: str) -> bool:
        """Whether the job's start in a host is under way: set up, or given to a host."""
        current = self.guardians.get(job_id)
        return job_id in self._setups or (current is not None and current.host is not None)

    def assign(self, job_id: str) -> None:
        """Give the job's guardian to the least loaded host with room, else a new host,
        once its set-up (on the set-up thread) is ready: the set-up's end gives it
        (`_set_up`), not the next round (at N=1,000 a round takes seconds). While
        `hosted_start_window` jobs are being started, a later round does it."""
        setup = self._setups.get(job_id)
        if setup is None:
            window = self.config.hosted_start_window
            if window > 0 and self._starting >= window:
                return
            self._starting += 1
            setup = self._setup.submit(job_id)
            self._setups[job_id] = setup
            setup.add_done_callback(lambda done: self._set_up(job_id, done))

    def _set_up(self, job_id: str, setup: Future[dict[str, str] | None]) -> None:
        """Job `job_id`'s set-up ended (on the set-up thread): give its guardian to a host
        now. A set-up that failed (logged) or was cancelled gives nothing: the next round
        asks again for a job still active."""
        with self._lock:
            if self._setups.get(job_id) is not setup:
                return  # dropped meanwhile (the job ended)
            del self._setups[job_id]
            env = None if setup.cancelled() else setup.result()
            if env is None:
                # Logged by the set-up; asked again after a pause, longer each time: every
                # try of a set-up changes etcd's auth (refusing every client's token).
                failures = self._setup_failures.get(job_id, 0) + 1
                self._setup_failures[job_id] = failures
                delay = min(self.config.max_backoff_s, 0.25 * 2**failures)
                self.not_before[job_id] = time.monotonic() + delay
                return
            self._setup_failures.pop(job_id, None)
            if not self._stop.is_set():
                self._give(job_id, env)

    def _give(self, job_id: str, env: dict[str, str]) -> None:
        self._drop_dead_hosts()
        while True:
            room = [h for h in self.hosts if len(h.jobs) < self.config.guardians_per_host]
            host = min(room, key=lambda h: len(h.jobs)) if room else self.start_host()
            if host is None:
                log.warning("job %s: no guardian host took it; trying again next round", job_id)
                return
            if host.give(job_id, env):
                break
            # Its input is closed (it is exiting, or died): the next host, or a new one.
            log.info("guardian host %s takes no more jobs", host.host_id)
            host.close()
            with contextlib.suppress(ValueError):
                self.hosts.remove(host)
        self.guardians[job_id] = Supervised(
            job_id, host.ref, child=host.proc is not None, host=host
        )
        log.info("job %s: guarded in host %s (pid %d)", job_id, host.host_id, host.ref.pid)

    def _drop_dead_hosts(self) -> None:
        for host in [h for h in self.hosts if not h.ref.alive()]:
            host.close()
            self.hosts.remove(host)

    def find_hosts(self) -> None:
        """Connect to the guardian hosts an earlier LCM started that still run (their
        sockets under `<data-dir>/guardian-hosts/`): after a daemon restart or a standby's
        takeover they take new jobs again, before any new host is started. Their jobs are
        re-adopted through their guardian keys as usual; a dead host's socket is removed."""
        known = {h.host_id for h in self.hosts}
        directory = self.config.data_dir / "guardian-hosts"
        for path in sorted(directory.glob("*.sock")) if directory.is_dir() else []:
            if path.stem in known:
                continue
            try:
                conn, about = connect_host(path)
            except ConnectionRefusedError:  # nobody listens: its host died
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            except OSError as exc:
                log.warning("guardian host socket %s: %s; not used", path, exc)
                continue
            ref = procs.ProcRef(int(about["pid"]), int(about.get("start") or 0))
            if about["host_id"] != path.stem or not ref.alive():
                conn.close()
                continue
            # A host reads its assignments one at a time, adopting each (a burst of jobs
            # fills the socket's buffer meanwhile); one that stops reading for a minute
            # is given up on rather than holding the LCM's round.
            conn.settimeout(60.0)
            jobs = {str(j) for j in about.get("jobs") or []}
            host = GuardianHostProcess(path.stem, None, ref, jobs, conn=conn)
            self.hosts.append(host)
            log.info(
                "found guardian host %s (pid %d, %d jobs): it takes new jobs again",
                host.host_id,
                ref.pid,
                len(jobs),
            )

    def start_host(self) -> GuardianHostProcess | None:
        if self._stop.is_set():  # a round still running while stop() gathers the hosts:
            return None  # a host started now would outlive the LCM, guarding on its own
        host_id = f"{self.id}-{uuid.uuid4().hex[:6]}"
        argv = [sys.executable, "-m", "services.guardian.host", f"--host-id={host_id}"]
        argv += [f"--lease-ttl={self.config.host_lease_ttl_s}", *self.guardian_args()]
        log_dir = self.config.data_dir / "guardian-hosts"
        log_dir.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
        try:
            log_fd = os.open(log_dir / f"{host_id}.log", flags, 0o600)
        except OSError as exc:
            log.error("cannot open a guardian host's log (%s); not starting one", exc)
            return None
        with os.fdopen(log_fd, "ab") as logf:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=self.guardian_process_env(),
                start_new_session=True,
            )
        ref = procs.ProcRef.of(proc.pid) or procs.ProcRef(proc.pid, -1)
        host = GuardianHostProcess(host_id, proc, ref)
        self.hosts.append(host)
        self.reaper.watch(proc.pid, lambda pid, code: self._host_exited(host, code))
        log.info("started guardian host %s, pid %d", host_id, proc.pid)
        return host

    def _host_exited(self, host: GuardianHostProcess, code: int) -> None:
        """Every job of the host lost its guardian at once: each is restarted like a
        guardian process that exited so (a new host, resuming from etcd)."""
        host.close()
        with self._lock:
            jobs = sorted(host.jobs)
            host.jobs.clear()
            with contextlib.suppress(ValueError):
                self.hosts.remove(host)
        log.warning("guardian host %s exited with %d; its %d jobs", host.host_id, code, len(jobs))
        for job_id in jobs:
            self._guardian_exited(job_id, host.ref.pid, code)

    def guardian_args(self) -> list[str]:
        """The flags every guardian (process or host) gets."""
        argv = [f"--data-dir={self.config.data_dir}", f"--backend={self.config.backend}"]
        if self.config.tds_address:
            argv.append(f"--tds={self.config.tds_address}")
        if self.config.scheduler_address:
            argv.append(f"--scheduler={self.config.scheduler_address}")
        return argv

    def guardian_process_env(self) -> dict[str, str]:
        # The store URIs go in the environment, not argv: any local user (a learner uid
        # included) can read a command line in /proc, and either URI may carry a password.
        env = dict(os.environ, **self.config.guardian_env)
        env[GUARDIAN_ETCD_URL_ENV] = self.config.etcd_url
        env[GUARDIAN_MONGODB_URI_ENV] = self.config.mongodb_uri
        return env

    def job_env(self, job_id: str) -> dict[str, str] | None:
        """The job's credentials for its guardian process (its environment): its etcd user
        made now (a guardian process per job; a hosted job's set-up is batched on the
        set-up thread instead), and the rest (`_job_env_rest`). None, logged, when one
        cannot be made (the guardian is not started)."""
        env = self._job_env_rest(job_id)
        if env is None or self.config.etcd_root is None or self._users is None:
            return env
        try:  # the same password for every guardian of the job: running learners keep theirs
            user = self._users.add(job_id, job_etcd_password(self.config.etcd_root, job_id))
        except StoreUnavailable as exc:
            log.error(
                "job %s: cannot make its etcd user (%s); not starting its guardian", job_id, exc
            )
            return None
        env[JOB_ETCD_CREDENTIALS_ENV] = user.line()
        return env

    def _job_env_rest(self, job_id: str) -> dict[str, str] | None:
        """A job's credentials but its etcd user: its token, the service credential, its
        TLS client certificate. None, logged, when one cannot be made."""
        env: dict[str, str] = {}
        if self.config.job_token is not None:
            env[JOB_TOKEN_ENV] = self.config.job_token(job_id)
        if self.config.scheduler_address and self.config.service_token is not None:
            env[GUARDIAN_SERVICE_TOKEN_ENV] = self.config.service_token()
        if self.config.job_tls is not None:
            try:
                env[JOB_TLS_ENV] = json.dumps(self.config.job_tls(job_id))
            except Exception as exc:  # the CA is unreadable: the learners could not log
                log.error(
                    "job %s: cannot issue its TLS client certificate (%s); not starting its guardian",
                    job_id,
                    exc,
                )
                return None
            if self.config.job_tls_dir is not None:
                env[JOB_TLS_DIR_ENV] = str(self.config.job_tls_dir)
        return env

    def spawn(self, job_id: str) -> None:
        if self._stop.is_set():  # as start_host: nothing new while stopping
            return
        job_dir = self.config.data_dir / "jobs" / job_id
        job_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "services.guardian", f"--job-id={job_id}"]
        argv += self.guardian_args()
        job_env = self.job_env(job_id)
        if job_env is None:
            return
        env = {**self.guardian_process_env(), **job_env}
        # The job directory may belong to the job's learner uid (local backend as root):
        # a link it left at guardian.log is refused, not followed as root.
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            log_fd = os.open(job_dir / "guardian.log", flags, 0o600)
        except OSError as exc:
            log.error("job %s: cannot open its guardian.log (%s); not starting it", job_id, exc)
            return
        if os.fstat(log_fd).st_nlink != 1:
            os.close(log_fd)
            log.error("job %s: its guardian.log is a hard link; not starting it", job_id)
            return
        with os.fdopen(log_fd, "ab") as logf:
            proc = subprocess.Popen(
                argv,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        ref = procs.ProcRef.of(proc.pid) or procs.ProcRef(proc.pid, -1)
        self.guardians[job_id] = Supervised(job_id, ref, child=True)
        self.reaper.watch(proc.pid, lambda pid, code: self._guardian_exited(job_id, pid, code))
        log.info("job %s: started guardian pid %d", job_id, proc.pid)

    def _guardian_exited(self, job_id: str, pid: int, code: int) -> None:
        with self._lock:
            current = self.guardians.get(job_id)
            lived = time.monotonic() - current.started if current else 0.0
            if current is not None and current.ref.pid == pid:
                self.guardians.pop(job_id)
            if code in (ExitCode.OK, GUARDIAN_ALREADY_GUARDED):
                self.failures.pop(job_id, None)
                self.not_before.pop(job_id, None)
                if code == ExitCode.OK:
                    self._job_ended(job_id)
            else:
                # The first restart is immediate; a guardian that keeps dying backs off.
                failures = 0 if lived > 30 else self.failures.get(job_id, 0) + 1
                self.failures[job_id] = failures
                delay = 0.0 if failures <= 1 else min(self.config.max_backoff_s, 0.25 * 2**failures)
                self.not_before[job_id] = time.monotonic() + delay
                log.warning(
                    "job %s: guardian pid %d exited with %d; restart in %.1fs",
                    job_id,
                    pid,
                    code,
                    delay,
                )
        with contextlib.suppress(StoreUnavailable):
            held = self.etcd.get(etcd_keys.guardian_lease(job_id))
            if held is not None and isinstance(held.value, dict) and held.value.get("pid") == pid:
                self.etcd.revoke(held.lease)  # it is dead: the next guardian need not wait
        self._mark(job_id)

    def collect(self, job_id: str, held: object) -> None:
        """Erase what a finished job left (a guardian that died after writing the end)."""
        # Read here, not taken from the watched view: its guardian may have just erased
        # them (the usual end), and the view may not have heard yet; a job collected
        # twice would have its etcd user removed twice (an auth change each time).
        left = self.etcd.get_prefix(etcd_keys.job_prefix(job_id))
        if not left:
            return
        held = left.get(etcd_keys.guardian_lease(job_id))
        if held is not None:
            value = getattr(held, "value", {})
            if isinstance(value, dict) and procs.ref_alive(value.get("pid"), value.get("start")):
                return  # its guardian is still finishing
        try:
            job = self.jobs.get(job_id)
            if job.status in states.ACTIVE_STATES:
                return
        except JobNotFound:
            pass  # purged: whatever it left is garbage too
        self.backend.rollback(job_id, str(self.config.data_dir / "jobs" / job_id))
        self.etcd.delete_prefix(etcd_keys.job_prefix(job_id))
        self._job_ended(job_id)
        log.info("job %s: collected leftover keys", job_id)

    def _job_ended(self, job_id: str) -> None:
        """Once no learner of the job runs (it ended or was halted; not when its guardian
        merely stopped with the daemon, whose learners carry on under a new guardian):
        delete its etcd user (a resume makes it again) and, when it ended for good, the
        file of its data-store credentials."""
        try:
            status = self.jobs.get(job_id).status
        except JobNotFound:
            status = states.DELETED
        except StoreUnavailable as exc:
            log.warning("job %s: its etcd user and credentials are kept (%s)", job_id, exc)
            return
        if status in states.ACTIVE_STATES:
            return
        if status != states.HALTED:  # a resume deploys it again with them
            JobSecrets.in_data_dir(self.config.data_dir).remove(job_id)
        # On the set-up thread, in a batch with other removals and set-ups (logged there if
        # it fails): its two auth changes refuse every client's token like a set-up's.
        self._setup.remove(job_id)

    # -- requests (any replica answers them) -------------------------------------------------
    def request(self, job_id: str, action: str, reason: str) -> str:
        """Halt or delete: tell the guardian through the control key; with no guardian
        (nothing deployed yet) move the record directly."""
        self.etcd.put(
            etcd_keys.control(job_id), {"action": action, "reason": reason, "time": time.time()}
        )
        target = states.HALTED if action == "halt" else states.DELETED
        held = self.etcd.get(etcd_keys.guardian_lease(job_id))
        job = self.jobs.get(job_id)
        if held is None and job.status in (states.PENDING, states.QUEUED):
            with contextlib.suppress(StaleToken, states.IllegalTransition):
                self.jobs.transition(job_id, target, reason, expect_version=job.version)
                self.etcd.delete(etcd_keys.control(job_id))
                if target == states.DELETED:  # never deployed: nothing else removes them
                    JobSecrets.in_data_dir(self.config.data_dir).remove(job_id)
                return f"job {job_id} {target.lower()}"
        self._mark(job_id)
        return f"{action} of job {job_id} requested"

    def resume(self, job_id: str, reason: str) -> str:
        job = self.jobs.get(job_id)
        if job.status != states.HALTED:
            raise states.IllegalTransition(job_id, job.status, states.QUEUED)
        self.etcd.delete_prefix(etcd_keys.job_prefix(job_id))
        # Back through the queue like a new job, not onto its old placement: the cluster
        # and the quotas may have changed while it was halted, and a job running outside
        # the scheduler's view would let it over-commit nodes.
        self.jobs.transition(
            job_id,
            states.QUEUED,
            reason,
            expect_version=job.version,
            placement=None,
            queue_reason="",
        )
        self._mark(job_id)
        return f"job {job_id} is queued again; it is placed like a new job"
