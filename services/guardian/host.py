"""A guardian host: the guardians of many jobs in one process (docs/control-plane-scale.md).

`python -m services.guardian.host --host-id H --data-dir D ...` runs `Guardian.step` for
every job it is given instead of a process per job. A job is given on its standard input,
one JSON line `{"job_id": J, "env": {...}}` per job (the LCM writes them; `env` holds the
job's credentials, as a guardian process gets them in its environment: a pipe is read
by no one else). What the guardians share:

- **one lease**: the host grants one and keeps it alive; each job's guardian key is
  created under it, naming the host's pid and start time (fencing as a process guardian:
  a second guardian for the job finds the key and stays out). A lost lease stops the host
  and every guardian in it (`EXIT_LEASE_LOST`); their keys go with the lease and the next
  host resumes each job from its steps in etcd;
- **one watch** on the jobs prefix (`PrefixWatch`), dispatching a change to the guardian
  of its job by the key's job id;
- **one MongoDB client**, one etcd client, one backend and one reaper (the host is a child
  subreaper: what its guardians start is reaped by it).

A guardian steps on the step pool when a change of its job arrives (any key under its
job's prefix: a learner's status, the control key, a lease's expiry) or, for the host's
local children, when a learner's controller exits (the reaper). Without either it steps
by a timer only for what no change reports: every `--poll` seconds (2) while its
learners start (their start grace is counted in time) or its halt waits, and otherwise
once every `--safety-poll` seconds (30), the safety net behind the watch (issue #18: at
a 2 s poll every running job cost its host a full round of etcd reads every 2 s, the
largest steady cost per alive job). The timers are a heap, not a scan of every guardian.
Until its job is deployed its steps run on the deploy pool instead (a deploy attempt
blocks on the backend), which bounds how many deploy at once. A step that raises restarts that
guardian (a fresh `Guardian`, like a new process) with exponential backoff; the host
goes on. A guardian that ends (done, another guardian holds the job, terminated) is
dropped and its key deleted.

A host also listens on a Unix socket, `<data-dir>/guardian-hosts/<host>.sock` (0600, and
only a peer of the host's own uid is heard: SO_PEERCRED), where an LCM that did not start
it (a restarted daemon's, a standby's after a takeover) connects, reads one JSON line
about the host (`{"host_id", "pid", "start", "jobs"}`) and then gives it jobs as on the
standard input. So new jobs fill the hosts that already run before new hosts start.

The host exits once its standard input is closed, no LCM is connected to its socket and
no guardian is left (0), when its
lease is lost (`EVICTED`, 4), or on SIGTERM after its guardians detached (`PREEMPTED`).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import json
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from contract import etcd_keys, procs
from contract.etcd import EtcdClient, Lease
from contract.etcd_watch import Change, PrefixWatch
from contract.status import ExitCode
from services.backends.api import Backend, BackendTimeout, JobSpec, TimedBackend, get_backend
from services.guardian.__main__ import WaitingReaper, pop_job_credentials, quiet_grpc_waits
from services.guardian.config import GuardianConfig
from services.guardian.guardian import (
    EXIT_ALREADY_GUARDED,
    EXIT_DONE,
    EXIT_LEASE_LOST,
    EXIT_TERMINATED,
    Guardian,
    job_over,
)
from services.security.api import GUARDIAN_ETCD_URL_ENV, GUARDIAN_MONGODB_URI_ENV
from services.store.errors import StoreUnavailable
from services.store.jobs import JobsRepository
from services.store.mongo import connect
from services.store.preemption_stats import PreemptionStatsRepository

log = logging.getLogger("rhizome.guardian.host")

# What a guardian step that raised counts as (it is restarted inside the host).
STEP_CRASHED = -1

# The job whose guardian the current thread is working for (a step, an adoption): the
# host's log lines of that work also go to the job's own guardian.log (JobLogHandler).
_working_for = threading.local()


@contextlib.contextmanager
def working_for(job_id: str) -> Iterator[None]:
    previous = getattr(_working_for, "job_id", None)
    _working_for.job_id = job_id
    try:
        yield
    finally:
        _working_for.job_id = previous


class JobLogHandler(logging.Handler):
    """Writes each log line of a hosted guardian's work to `<data-dir>/jobs/<job>/
    guardian.log` too, where a guardian process's lines go: an operator debugging one job
    reads the same file whether its guardian ran in a process or in a host (whose own log,
    `<data-dir>/guardian-hosts/<host>.log`, has every job's lines). Lines logged outside a
    guardian's step (the watch, the lease, the pools' bookkeeping) are the host's alone.
    The file is opened for each line, so a host of many jobs holds no descriptor per job;
    as the LCM opens a guardian process's log, a link left at guardian.log (the job
    directory may belong to the job's learner uid) is refused, not followed."""

    def __init__(self, jobs_dir: Path, host_id: str) -> None:
        super().__init__(logging.INFO)
        self.jobs_dir = jobs_dir
        self.setFormatter(
            logging.Formatter(
                f"%(asctime)s %(levelname)s guardian[%(job)s] host[{host_id}]: %(message)s"
            )
        )

    def emit(self, record: logging.LogRecord) -> None:
        job_id = getattr(_working_for, "job_id", None)
        if not job_id or "/" in job_id or job_id.startswith("."):
            return
        record.job = job_id
        try:
            line = (self.format(record) + "\n").encode(errors="replace")
            job_dir = self.jobs_dir / job_id
            job_dir.mkdir(parents=True, exist_ok=True)
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
            fd = os.open(job_dir / "guardian.log", flags, 0o600)
            try:
                if os.fstat(fd).st_nlink == 1:
                    os.write(fd, line)
            finally:
                os.close(fd)
        except (OSError, ValueError):  # the job's file is unusable: the host's log has it
            pass


def socket_path(data_dir: Path, host_id: str) -> Path:
    """Where host `host_id` takes assignments from an LCM that did not start it."""
    return data_dir / "guardian-hosts" / f"{host_id}.sock"


@contextlib.contextmanager
def unix_address(path: Path) -> Iterator[str]:
    """`path` as a Unix socket address: itself, or (past the 108 bytes an address holds,
    a deep data directory) the same file through a descriptor of its directory."""
    if len(os.fsencode(path)) < 100:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (the kernel says)."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", raw)[1])


def connect_host(path: Path, timeout_s: float = 5.0) -> tuple[socket.socket, dict[str, Any]]:
    """Connect to a guardian host's socket; returns the connection and what the host says
    of itself (`host_id`, `pid`, `start`, `jobs`). OSError if none listens there (a dead
    host's file: ConnectionRefusedError) or it is not ours or does not answer."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout_s)
        with unix_address(path) as address:
            conn.connect(address)
        if peer_uid(conn) != os.getuid():
            raise PermissionError(f"{path} is served by another user")
        hello = b""
        while not hello.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                raise ConnectionError(f"{path}: the host closed the connection")
            hello += chunk
        about = json.loads(hello)
        if not isinstance(about, dict) or not about.get("host_id") or not about.get("pid"):
            raise ConnectionError(f"{path}: not a guardian host's greeting")
        return conn, about
    except OSError:
        conn.close()
        raise
    except ValueError as exc:  # not JSON
        conn.close()
        raise ConnectionError(f"{path}: not a guardian host's greeting") from exc


# A host's lease TTL. A guardian process's lease is 2 s; a host's is longer because it
# lapses for a different reason: at N=1,000 under load 20 (benchmarks/RESULTS.md) a host's
# 2 s lease expired while its keep-alive thread waited for the GIL behind hundreds of
# guardians' steps, and all its jobs moved at once. The lease only fences the host (its
# jobs' guardian keys); the learners' leases are their own, so a longer TTL delays
# nothing a learner does. Nor does it delay recovery from a dead host: the LCM revokes a
# dead holder's lease as soon as it sees the pid gone (LifecycleManager.ensure_guardian).
# It only lengthens how long a live host cut off from etcd keeps its jobs fenced.
HOST_LEASE_TTL_S = 10
# How often a host looks whether its etcd clients re-authenticated (and logs it if so).
REAUTH_REPORT_S = 5.0
# The main loop sleeps until the next thing it must do by the clock (a guardian's poll or
# backoff, the re-authentication report) or until an event sets `changed` (a guardian
# ended, a step finished, the input closed, an LCM disconnected, the lease lost, SIGTERM):
# it no longer ticks at 10 Hz whether or not anything is due (issue #16: a running job's
# platform processes share the cores its workers train on). A wait by the clock is at
# least LOOP_MIN_S, the granularity the loop always had: 100 guardians polling every 2 s
# are due ~50 times a second, stepped in batches of those due within 0.1 s rather than
# one scan of them all per guardian.
LOOP_MIN_S = 0.1
# A settled guardian's full round without any change of its job (HostConfig.safety_poll_s).
# Every transition a running job makes arrives by the host's watch: a learner's status
# write, the control key (halt, delete), a controller's death (its lease expires and its
# status key goes; on the local backend its exit, reported by the host's reaper, at once),
# the host's own lease (the keep-alive thread). What only a timer sees is a learner that
# has not written its first status (its start grace), a halt's deadline, a helper that
# died (started again), and a certificate due for renewal (hours): the first two keep the
# `--poll` period, the last two wait for this one (tests/services/guardian/
# test_host_change_driven.py).
HOST_SAFETY_POLL_S = 30.0


@dataclass
class HostConfig:
    host_id: str
    lease_ttl_s: int = HOST_LEASE_TTL_S
    # A guardian whose learners are starting (or whose halt waits: `halt_poll_s`) steps
    # this often without a change of its job.
    poll_s: float = 2.0
    # A settled one (every learner has a status) this often: the safety net behind the
    # watch (HOST_SAFETY_POLL_S).
    safety_poll_s: float = HOST_SAFETY_POLL_S
    step_threads: int = 4
    deploy_threads: int = 4
    max_backoff_s: float = 10.0
    # Per kind of backend call, how long it may take (services/backends/api.py
    # CALL_TIMEOUTS_S, which these override): a stuck call must not hold a pool thread.
    backend_timeouts: dict[str, float] = field(default_factory=dict)
    # While a guardian's halt waits for its learners to save and stop, it steps this
    # often (besides every change of its job): the halt's deadline is checked then.
    halt_poll_s: float = 0.5


class HostedGuardian(Guardian):
    """A guardian in a host. Its halt does not wait for the learners inside a step (a
    step thread held for their grace period, up to `--step-threads` halts stopping every
    other job's steps): each step asks once whether any learner still runs, and returns
    None (not done) until none does or the halt's deadline passed, then ends the halt as
    `Guardian.halt` does. The host steps a halting guardian every `halt_poll_s`, and at
    once on a change of its job (a learner's status, its lease going)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.halt_deadline: float | None = None  # set while a halt waits for learners

    def halt(self, spec: JobSpec) -> int | None:
        now = time.monotonic()
        if self.halt_deadline is None:
            self.halt_deadline = now + spec.grace_s + 5
            log.info("job %s: halting; its learners have %g s to save", self.job_id, spec.grace_s)
        busy = self.halt_busy()
        if busy and now < self.halt_deadline:
            return None
        return self.halt_end(spec, busy)

    def idle_s(self, config: HostConfig) -> float:
        """How long after its last step the host steps this guardian if no change of its
        job comes first: `halt_poll_s` while a halt waits; `poll_s` while something is
        counted in time (a deploy, a learner with no status yet: its start grace, a
        controller found dead, our guardian key seen deleted); else `safety_poll_s`."""
        if self.halt_deadline is not None:
            return min(config.poll_s, config.halt_poll_s)
        if self.watching is None or not self._settled or self.key_deleted:
            return config.poll_s
        return max(config.poll_s, config.safety_poll_s)

    def runs_controller(self, pid: int) -> bool:
        """Whether `pid` is one of this guardian's learner controllers (started by it, or
        holding a status key it saw)."""
        if pid in list(self.handles.values()):
            return True
        return any(
            isinstance(e.value, dict) and e.value.get("pid") == pid
            for e in list(self._seen.values())
        )


@dataclass
class Hosted:
    """One job's guardian in the host, and when it steps next."""

    job_id: str
    guardian: Guardian
    make: Callable[[], Guardian]  # a fresh guardian for the job (a restart)
    running: bool = False  # a step is on a pool
    due: bool = False  # a change arrived while it ran: step again at once
    next_step: float = 0.0
    failures: int = 0
    started: float = field(default_factory=time.monotonic)


class GuardianHost:
    def __init__(
        self,
        config: HostConfig,
        etcd: EtcdClient,
        jobs: JobsRepository,
        backend: Backend,
        make_config: Callable[[str, dict[str, str]], GuardianConfig],
        stats: PreemptionStatsRepository | None = None,
        reaper: WaitingReaper | None = None,
    ) -> None:
        self.config = config
        # The host's reaper (its children: the local backend's learner controllers): a
        # controller's exit steps its guardian at once (`_on_child_exit`).
        self.reaper = reaper
        self.etcd = etcd
        self.jobs = jobs
        # Every call that can wait bounded (TimedBackend): a step or deploy thread waits
        # for a stuck engine at most its call's timeout, and the job's history says which
        # call it was. A call the backend marks `cannot_block` runs in the step's thread,
        # with no hop to the wrapper's pool and back (a monitoring round's two calls on
        # the local and simulated backends; TimedBackend says why docker's and
        # Kubernetes' keep their bound).
        self.backend = (
            backend
            if isinstance(backend, TimedBackend)
            else TimedBackend(backend, config.backend_timeouts, on_timeout=self._timed_out)
        )
        self.stats = stats
        self.make_config = make_config
        self.guardians: dict[str, Hosted] = {}
        self.lease: Lease | None = None
        self.ended: dict[str, int] = {}  # job -> how its guardian ended (tests, logs)
        self.terminate = threading.Event()
        self.changed = threading.Event()  # something for the main loop to look at
        self._lock = threading.RLock()
        self._watch: PrefixWatch | None = None
        self._listener: socket.socket | None = None
        self._socket_path: Path | None = None
        self._inputs = 0  # LCM connections open on the socket (the host stays for them)
        self._loop_wakes_at = 0.0  # when `run`'s loop wakes by itself next (monotonic)
        # (when, n, job): a guardian's next step by the clock, pushed whenever it is set
        # (`_set_next_step`); an entry whose guardian's next step moved on is skipped when
        # it comes up. `tick` pops the due ones instead of scanning every guardian.
        self._timers: list[tuple[float, int, str]] = []
        self._timer_seq = itertools.count()
        self._steps = ThreadPoolExecutor(config.step_threads, thread_name_prefix="step")
        self._deploys = ThreadPoolExecutor(config.deploy_threads, thread_name_prefix="deploy")

    # -- life ---------------------------------------------------------------------------
    def start(self) -> GuardianHost:
        # Refreshed from a thread of its own (_keep_alive, every TTL/4), never from
        # the step or deploy pools nor the main loop: a pool full of slow steps (a stuck
        # backend call, a halt waiting out its grace period) cannot starve it.
        lease = self.etcd.grant(self.config.lease_ttl_s)
        self.lease = lease
        threading.Thread(
            target=self._keep_alive, args=(lease,), name="host-lease", daemon=True
        ).start()
        self._watch = PrefixWatch(self.etcd, etcd_keys.jobs_prefix(), self._on_change).start()
        if self.reaper is not None:
            self.reaper.on_exit = self._on_child_exit
        return self

    def _keep_alive(self, lease: Lease) -> None:
        """Refresh the host's lease every TTL/4 (as `Lease.keep_alive`), and count it lost
        once no refresh has succeeded for a whole TTL: etcd has let it expire by then (its
        guardian keys are gone, another host may hold the jobs), and a host that cannot
        reach etcd at all (it was stopped, the machine cut off) would otherwise go on
        guarding jobs it no longer holds, forever."""
        period = max(0.2, lease.ttl / 4)
        last_ok = time.monotonic()
        while not lease._stop.wait(period):  # set by Lease.revoke (close)
            try:
                if not lease.refresh():
                    break  # expired: refresh() set lost
                last_ok = time.monotonic()
            except Exception as exc:  # etcd away for a moment: try again next period
                if time.monotonic() - last_ok > lease.ttl:
                    log.warning("no lease refresh for %d s (%s): the lease is lost", lease.ttl, exc)
                    lease.lost.set()
                    break
        self.changed.set()

    def stop(self) -> None:
        """Every guardian detaches (its learners save and stop, the job stays as it is),
        then the lease goes: the next guardian of each job carries on."""
        with self._lock:
            hosted = list(self.guardians.values())
        for h in hosted:
            h.guardian.terminate.set()
            self._schedule(h.job_id, now=True)
        deadline = time.monotonic() + 30
        while self.guardians and time.monotonic() < deadline:
            self.changed.wait(0.1)
            self.changed.clear()
        self.close()

    def listen(self, path: Path) -> None:
        """Take assignments on a Unix socket at `path` too (the module's docstring)."""
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a dead host's of the same id: ids are unique, it is garbage
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with unix_address(path) as address:
            listener.bind(address)
        os.chmod(path, 0o600)
        listener.listen(16)
        self._listener, self._socket_path = listener, path
        threading.Thread(target=self._accept, name="listen", daemon=True).start()

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed: the host is stopping
                return
            try:
                uid = peer_uid(conn)
            except OSError:
                conn.close()
                continue
            if uid != os.getuid():  # only the platform's own processes give jobs
                log.warning("refused a connection to the host's socket from uid %d", uid)
                conn.close()
                continue
            with self._lock:
                self._inputs += 1
            threading.Thread(
                target=self._serve, args=(conn,), name="lcm-input", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        """One LCM's connection: say who we are, then adopt the jobs it gives."""
        try:
            me = procs.ProcRef.of(os.getpid())
            with self._lock:
                jobs = sorted(self.guardians)
            hello = {
                "host_id": self.config.host_id,
                "pid": os.getpid(),
                "start": me.start if me else 0,
                "jobs": jobs,
            }
            conn.sendall((json.dumps(hello) + "\n").encode())
            with conn.makefile("r", encoding="utf-8", errors="replace") as lines:
                for line in lines:
                    self._assign(line)
        except OSError as exc:
            log.info("an LCM's connection ended: %s", exc)
        finally:
            conn.close()
            with self._lock:
                self._inputs -= 1
            log.info("an LCM disconnected from the host's socket")
            self.changed.set()

    def close(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
            if self._socket_path is not None:
                with contextlib.suppress(OSError):
                    self._socket_path.unlink()
        if self._watch is not None:
            self._watch.stop()
        self._steps.shutdown(wait=False, cancel_futures=True)
        self._deploys.shutdown(wait=False, cancel_futures=True)
        if isinstance(self.backend, TimedBackend):
            self.backend.close()
        if self.lease is not None:
            self.lease.revoke()

    def _timed_out(self, message: str) -> None:
        """A backend call gave up (TimedBackend, in the waiting thread): the job the
        thread works for gets the reason in its history; the thread goes on (the call's
        BackendError fails the deploy attempt, or the step, which restarts the guardian)."""
        job_id = getattr(_working_for, "job_id", None)
        log.error("%s", message)
        if job_id:
            with contextlib.suppress(Exception):  # the store away: the log has it
                self.jobs.note(job_id, message)

    # -- jobs ---------------------------------------------------------------------------
    def adopt(self, job_id: str, env: dict[str, str] | None = None) -> bool:
        """Guard job `job_id` in this host: take its guardian key under the host's lease
        (False if a live guardian holds it: fenced out) and schedule its first step."""
        assert self.lease is not None, "start() the host first"
        with self._lock:
            if job_id in self.guardians:
                return True
        config = self.make_config(job_id, dict(env or {}))

        def make() -> Guardian:
            guardian = HostedGuardian(config, self.etcd, self.jobs, self.backend, self.stats)
            guardian.lease = self.lease
            guardian.poll_s = self.config.poll_s
            return guardian

        with working_for(job_id):
            guardian = make()
            if not guardian.acquire(self.lease, host=self.config.host_id):
                log.info("job %s already has a live guardian", job_id)
                self.ended[job_id] = EXIT_ALREADY_GUARDED
                return False
            with self._lock:
                self.guardians[job_id] = Hosted(job_id, guardian, make)
            log.info(
                "job %s: guarded in host %s (pid %d; the host's log: guardian-hosts/%s.log)",
                job_id,
                self.config.host_id,
                os.getpid(),
                self.config.host_id,
            )
        self._schedule(job_id, now=True)
        return True

    def _on_change(self, changes: list[Change], full: bool) -> None:
        """The watch's thread: wake the guardian of each changed job (a dictionary
        lookup; the step runs on a pool). After a fresh read of the prefix (`full`: the
        watch was broken and changes may have been compacted away) every guardian steps."""
        by_job: dict[str, list[Change]] = {}
        for change in changes:
            by_job.setdefault(etcd_keys.job_of(change.key) or "", []).append(change)
        if full:
            with self._lock:
                for job_id in self.guardians:
                    by_job.setdefault(job_id, [])
        for job_id, of_job in by_job.items():
            hosted = self.guardians.get(job_id)
            if hosted is not None:
                # sets its wake (a guardian waiting inside halt() sees it too) and notes
                # its own guardian key's deletion (`key_deleted`: it polls again)
                hosted.guardian._on_change(of_job, full)
                self._schedule(hosted.job_id, now=True)

    def _on_child_exit(self, pid: int) -> None:
        """The reaper's thread: a child of the host exited. If it was a learner's
        controller, its guardian steps now (which finds it dead, revokes its lease and
        starts a new one) rather than when its lease expires and the watch says so."""
        with self._lock:
            hosted = list(self.guardians.values())
        for h in hosted:
            runs = getattr(h.guardian, "runs_controller", None)
            if callable(runs) and runs(pid):
                h.guardian.wake.set()
                self._schedule(h.job_id, now=True)

    def _schedule(self, job_id: str, now: bool = False) -> None:
        with self._lock:
            hosted = self.guardians.get(job_id)
            if hosted is None:
                return
            if hosted.running:
                hosted.due = hosted.due or now
                return
            if not now and time.monotonic() < hosted.next_step:
                return
            hosted.running = True
            hosted.due = False
        pool = self._deploys if hosted.guardian.watching is None else self._steps
        try:
            pool.submit(self._step, hosted)
        except RuntimeError:  # the pools are shut down: the host is stopping
            hosted.running = False

    def _step(self, hosted: Hosted) -> None:
        with working_for(hosted.job_id):
            try:
                hosted.guardian.wake.clear()
                code = hosted.guardian.step()
            except BackendTimeout as exc:  # in its history already (_timed_out)
                log.warning("job %s: the guardian's step gave up: %s", hosted.job_id, exc)
                code = STEP_CRASHED
            except Exception:
                log.exception("job %s: the guardian's step failed", hosted.job_id)
                code = STEP_CRASHED
        with self._lock:
            hosted.running = False
            idle_s = getattr(hosted.guardian, "idle_s", None)
            period = idle_s(self.config) if callable(idle_s) else self.config.poll_s
            self._set_next_step(hosted, time.monotonic() + period)
            if code is not None:
                again = self._guardian_ended(hosted, code)
            else:  # a change came meanwhile, or a deploy step ended: on at once
                again = hosted.due or hosted.guardian.watching is None
            # The main loop sleeps until the earliest step it knew of: wake it if this
            # one is due sooner (a poll shorter than its sleep, a restart's backoff).
            if hosted.next_step < self._loop_wakes_at:
                self.changed.set()
        if again:
            self._schedule(hosted.job_id, now=True)

    def _guardian_ended(self, hosted: Hosted, code: int) -> bool:
        """Drop the guardian, or restart it (a fresh one) with backoff if its step
        raised. True when it should step again at once."""
        job_id = hosted.job_id
        if code == STEP_CRASHED and not self.terminate.is_set():
            lived = time.monotonic() - hosted.started
            hosted.failures = 0 if lived > 30 else hosted.failures + 1
            delay = (
                0.0
                if hosted.failures <= 1
                else min(self.config.max_backoff_s, 0.25 * 2**hosted.failures)
            )
            with working_for(job_id):
                log.warning("job %s: guardian restarted in the host in %.1fs", job_id, delay)
            hosted.guardian = hosted.make()
            hosted.started = time.monotonic()
            self._set_next_step(hosted, time.monotonic() + delay)
            return False
        self.guardians.pop(job_id, None)
        self.ended[job_id] = code
        if code == EXIT_LEASE_LOST:
            assert self.lease is not None
            self.lease.lost.set()
        elif code in (EXIT_DONE, EXIT_TERMINATED, STEP_CRASHED):
            # Ours, and nothing else uses it: gone now rather than with the host's lease.
            with contextlib.suppress(StoreUnavailable):
                held = self.etcd.get(etcd_keys.guardian_lease(job_id))
                if held is not None and self.lease is not None and held.lease == self.lease.id:
                    self.etcd.delete_if(held.key, held.mod_revision)
        with working_for(job_id):
            log.info("job %s: its guardian ended with %d", job_id, code)
        self.changed.set()
        return False

    def _set_next_step(self, hosted: Hosted, at: float) -> None:
        """When `hosted` steps next by the clock (under `_lock`)."""
        hosted.next_step = at
        heapq.heappush(self._timers, (at, next(self._timer_seq), hosted.job_id))

    def tick(self, until: float = float("inf")) -> float:
        """The timer: step every guardian whose poll period (or backoff) is over, popped
        from the timer heap (not a scan of every guardian). Returns when the main loop
        must look again: the earliest timer left, or `until` if sooner (monotonic). A
        guardian stepping now says when it is due as its step ends (`_step`), and wakes
        the loop if that is sooner: set under the same lock as the timers are read, so
        that no step's end falls in between."""
        now = time.monotonic()
        due = []
        with self._lock:
            while self._timers and self._timers[0][0] <= now:
                _, _, job_id = heapq.heappop(self._timers)
                hosted = self.guardians.get(job_id)
                # skipped: a guardian gone, stepping now (its end sets its next step), or
                # whose next step moved on since this entry (a later entry has it)
                if hosted is not None and not hosted.running and hosted.next_step <= now:
                    due.append(job_id)
            self._loop_wakes_at = min(self._timers[0][0], until) if self._timers else until
        for job_id in dict.fromkeys(due):
            self._schedule(job_id)
        return self._loop_wakes_at

    def run(self, assignments: Iterable[str] | None) -> int:
        """Adopt the jobs read from `assignments` (JSON lines, in a thread) and step until
        the input is closed and no guardian is left, the lease is lost, or terminate."""
        closed = threading.Event()
        if assignments is None:
            closed.set()
        else:
            threading.Thread(
                target=self._read, args=(assignments, closed), name="assign", daemon=True
            ).start()
        assert self.lease is not None
        reported = (0, 0)
        report_at = 0.0
        while True:
            # Cleared before anything is looked at: an event from here on ends the wait
            # below at once (cleared after the wait, one that came meanwhile was lost).
            self.changed.clear()
            if time.monotonic() >= report_at:
                reported = self.report_reauthentications(reported)
                report_at = time.monotonic() + REAUTH_REPORT_S
            if self.lease.lost.is_set():
                log.warning("host %s lost its lease: every guardian stops", self.config.host_id)
                self.close()
                return ExitCode.EVICTED
            if self.terminate.is_set():
                self.stop()
                return ExitCode.PREEMPTED
            if closed.is_set() and not self.guardians and not self._inputs:
                self.close()
                return ExitCode.OK
            wakes_at = self.tick(until=report_at)
            self.changed.wait(max(LOOP_MIN_S, wakes_at - time.monotonic()))

    def report_reauthentications(self, last: tuple[int, int]) -> tuple[int, int]:
        """Log how many new etcd tokens the host's client and its backend's (simulated
        learners) needed so far, when that changed: every auth change in etcd (the LCM adds
        and removes a user per job) refuses every client's token once, and
        benchmarks/control_plane_scale.py counts the storm from these lines."""
        learners = getattr(self.backend, "etcd_reauthentications", None)
        now = (self.etcd.reauthentications, int(learners()) if callable(learners) else 0)
        if now != last:
            log.info(
                "etcd re-authentications so far: host %d, learners %d (%d guardians)",
                now[0],
                now[1],
                len(self.guardians),
            )
        return now

    def _read(self, assignments: Iterable[str], closed: threading.Event) -> None:
        try:
            for line in assignments:
                self._assign(line)
        finally:
            closed.set()
            self.changed.set()

    def _assign(self, line: str) -> None:
        """One assignment line (the standard input's or the socket's): adopt its job."""
        if not line.strip():
            return
        try:
            message = json.loads(line)
            job_id = str(message["job_id"])
            env = {str(k): str(v) for k, v in dict(message.get("env") or {}).items()}
        except (ValueError, KeyError, TypeError) as exc:
            log.error("ignored an assignment that is not {job_id, env} JSON (%s): %.80r", exc, line)
            return
        try:
            self.adopt(job_id, env)
        except Exception:  # a bad job must not stop the others' assignments
            log.exception("job %s: cannot guard it", job_id)


def assignment(job_id: str, env: dict[str, str]) -> str:
    """The line that gives a host job `job_id` (what `GuardianHost.run` reads)."""
    return json.dumps({"job_id": job_id, "env": env}) + "\n"


def main(argv: list[str] | None = None, stdin: IO[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.guardian.host", description=__doc__)
    parser.add_argument("--host-id", required=True, help="names the host in its guardian keys")
    parser.add_argument(
        "--etcd", default="", help=f"etcd client URL (default: ${GUARDIAN_ETCD_URL_ENV})"
    )
    parser.add_argument(
        "--mongodb-uri", default="", help=f"MongoDB URI (default: ${GUARDIAN_MONGODB_URI_ENV})"
    )
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--backend", default="local")
    parser.add_argument("--tds", default="", help="TDS address for the learners' log collectors")
    parser.add_argument("--scheduler", default="", help="the scheduler's internal address")
    parser.add_argument(
        "--poll",
        type=float,
        default=2.0,
        help="seconds between steps without a change while a job's learners start or it halts",
    )
    parser.add_argument(
        "--safety-poll",
        type=float,
        default=HOST_SAFETY_POLL_S,
        help="seconds between steps of a running job without a change (behind the watch)",
    )
    parser.add_argument(
        "--lease-ttl",
        type=int,
        default=HOST_LEASE_TTL_S,
        help="seconds of the host's etcd lease (its jobs' guardian keys)",
    )
    parser.add_argument("--step-threads", type=int, default=4)
    parser.add_argument("--deploy-threads", type=int, default=4)
    parser.add_argument(
        "--job", action="append", default=[], help="guard this job too (no credentials; by hand)"
    )
    args = parser.parse_args(argv)
    quiet_grpc_waits()  # its watch's and lease's waits: as a guardian process's
    if args.poll <= 0 or args.safety_poll <= 0 or args.step_threads < 1 or args.deploy_threads < 1:
        parser.error(
            "--poll and --safety-poll must be above 0 and --step-threads, --deploy-threads "
            "at least 1"
        )
    if args.lease_ttl < 2:  # etcd's shortest lease (1.5 x its election timeout, rounded)
        parser.error("--lease-ttl must be at least 2 seconds")
    etcd_url = args.etcd or os.environ.pop(GUARDIAN_ETCD_URL_ENV, "")
    mongodb_uri = args.mongodb_uri or os.environ.pop(GUARDIAN_MONGODB_URI_ENV, "")
    os.environ.pop(GUARDIAN_ETCD_URL_ENV, None)
    os.environ.pop(GUARDIAN_MONGODB_URI_ENV, None)
    if not etcd_url or not mongodb_uri:
        parser.error(
            f"missing --etcd (or ${GUARDIAN_ETCD_URL_ENV}) or --mongodb-uri "
            f"(or ${GUARDIAN_MONGODB_URI_ENV})"
        )
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s guardian-host[{args.host_id}] %(threadName)s: %(message)s",
    )
    logging.getLogger().addHandler(JobLogHandler(args.data_dir / "jobs", args.host_id))

    def make_config(job_id: str, env: dict[str, str]) -> GuardianConfig:
        return GuardianConfig.from_env(
            job_id=job_id,
            etcd_url=etcd_url,
            mongodb_uri=mongodb_uri,
            data_dir=args.data_dir,
            backend=args.backend,
            tds_address=args.tds,
            scheduler_address=args.scheduler,
            **pop_job_credentials(env),
        )

    try:
        make_config("-", {})  # the knobs in the environment, checked once up front
        etcd = EtcdClient.connect(etcd_url)
        db = connect(mongodb_uri)
    except (StoreUnavailable, ValueError) as exc:
        print(f"guardian host: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    jobs = JobsRepository(db)
    procs.become_subreaper()
    # Asleep in `waitid` until a child exits, as a guardian process's reaper: the polling
    # Reaper woke 20 times a second in every host, jobs or not (issue #16).
    reaper = WaitingReaper()
    reaper.start()
    backend = get_backend(args.backend, reaper=reaper)
    host = GuardianHost(
        HostConfig(
            args.host_id,
            lease_ttl_s=args.lease_ttl,
            poll_s=args.poll,
            safety_poll_s=args.safety_poll,
            step_threads=args.step_threads,
            deploy_threads=args.deploy_threads,
        ),
        etcd,
        jobs,
        backend,
        make_config,
        PreemptionStatsRepository(db),
        reaper,
    )
    backend.release_ended(
        args.data_dir / "jobs", make_config("-", {}).objects_dir, lambda j: job_over(jobs, j)
    )

    def on_term(*_: object) -> None:
        host.terminate.set()
        host.changed.set()

    signal.signal(signal.SIGTERM, on_term)
    try:
        host.start()
    except StoreUnavailable as exc:
        print(f"guardian host: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        host.listen(socket_path(args.data_dir, args.host_id))
    except OSError as exc:  # the standard input still works: only a later LCM cannot reach it
        log.error("guardian host %s: cannot listen on its socket: %s", args.host_id, exc)
    for job_id in args.job:
        host.adopt(job_id)
    code = host.run(stdin if stdin is not None else sys.stdin)
    if code == ExitCode.EVICTED:
        # Now, not after the deploys in flight: without the lease they are no longer ours
        # (the pools' threads would be joined at exit). The OS closes what we hold.
        logging.shutdown()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
