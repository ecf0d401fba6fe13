"""The simulated backend: learners that train nothing, for measuring the control plane.

Each "learner" is a thread in the guardian's process that walks the real status path of
a learner controller: it claims its rank's etcd key under a lease, records STARTING,
DOWNLOADING and PROCESSING with the values a controller writes (``contract.status.
status_value``), appends
log lines to its ``stdout.log`` as a command would, and ends COMPLETED (or HALTED when
stopped). Everything the platform does around it (API, scheduler, LCM, guardian, etcd
watches, MongoDB transitions) is the real thing; only the process, the code download and
the training are left out. So N jobs cost what the control plane costs for N jobs, which
is what `benchmarks/control_plane_scale.py` measures.

How long a learner "trains" comes from the manifest's environment: ``SIM_SECONDS``
(default 5) and ``SIM_LOG_LINES`` (default 10, spread over that time); with
``SIM_UNTIL_FILE`` it goes on, after its lines, until that file exists (a benchmark holds
N jobs alive at once and ends them together: one thread of the backend looks for each
such file, not every learner, so that 1,000 learners waiting cost no CPU).
``SIM_LEASE_TTL_S`` sets the TTL of the learners' leases (default: a learner's, the
platform's ``RHIZOME_LEARNER_LEASE_TTL_S``, 10 s; a lease refreshed every TTL/4 by a
thread of its own, which at 1,000 learners in one process is most of that process's CPU,
and a real learner's process pays it, not the platform). Not a backend for users: `rhizomed
--backend simulated` says so in its log.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract import etcd_keys, procs
from contract.etcd import EtcdClient
from contract.learner_spec import LearnerSpec
from contract.status import ExitCode, LearnerStatus, status_value
from services.backends.api import Backend, BackendError, JobSpec, cannot_block
from services.backends.local.backend import learner_spec, prepare_job_dir, tail_logs

log = logging.getLogger(__name__)

DEFAULT_SECONDS = 5.0
DEFAULT_LOG_LINES = 10
UNTIL_POLL_S = 0.1


@dataclass
class _Learner:
    job_id: str
    rank: int
    thread: threading.Thread | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    exit_code: int | None = None
    # Set when it is stopped or its SIM_UNTIL_FILE appeared (`released`): what it waits on.
    wake: threading.Event = field(default_factory=threading.Event)
    released: bool = False


class SimulatedBackend(Backend):
    name = "simulated"

    def __init__(self, **_: Any) -> None:
        log.warning("backend 'simulated': learners train nothing (for control-plane benchmarks)")
        self._handles = itertools.count(1)
        self._learners: dict[int, _Learner] = {}
        self._lock = threading.Lock()
        self._etcd: dict[str, EtcdClient] = {}
        # SIM_UNTIL_FILE -> the learners waiting for it (one poller thread for them all)
        self._until: dict[str, list[_Learner]] = {}
        self._poller: threading.Thread | None = None

    # -- deploy steps -------------------------------------------------------------------
    def prepare_volume(self, job: JobSpec) -> None:
        try:
            prepare_job_dir(job)
        except OSError as exc:
            raise BackendError(f"cannot prepare the job directory: {exc}") from exc

    def write_secrets(self, job: JobSpec) -> None:
        """Nothing runs that could read them."""

    @cannot_block
    def start_helper(self, job: JobSpec) -> None:
        """Logs stay in the learners' files; nothing ships them."""

    def start_learner(self, job: JobSpec, rank: int, restart: int = 0) -> int:
        spec = learner_spec(job, rank, restart)
        learner = _Learner(job.job_id, rank)
        handle = next(self._handles)
        learner.thread = threading.Thread(
            target=self._learn,
            args=(spec, learner),
            name=f"sim-{job.job_id}-{rank}",
            daemon=True,
        )
        with self._lock:
            self._learners[handle] = learner
        learner.thread.start()
        return handle

    def etcd_reauthentications(self) -> int:
        """How many times the learners' etcd clients got a new token after etcd refused
        theirs (`EtcdClient.reauthentications`; each job's etcd user added or removed
        refuses every token once): what a guardian host reports for benchmarks."""
        with self._lock:
            return sum(c.reauthentications for c in self._etcd.values())

    # -- the simulated learner ----------------------------------------------------------
    def _client(self, url: str) -> EtcdClient:
        with self._lock:
            client = self._etcd.get(url)
        if client is None:
            # Made outside the lock (it may reach etcd): controller_alive takes that lock
            # and must not wait for etcd (cannot_block). A client made twice is dropped.
            made = EtcdClient(url)
            with self._lock:
                client = self._etcd.setdefault(url, made)
        return client

    def _learn(self, spec: LearnerSpec, learner: _Learner) -> None:
        seconds = float(spec.env.get("SIM_SECONDS", DEFAULT_SECONDS))
        lines = int(spec.env.get("SIM_LOG_LINES", DEFAULT_LOG_LINES))
        etcd = self._client(spec.etcd_url)
        key = etcd_keys.learner_status(spec.job_id, spec.rank)
        ttl = int(spec.env.get("SIM_LEASE_TTL_S", spec.lease_ttl_s))
        lease = etcd.grant(ttl).keep_alive()
        history: list[list[Any]] = []

        def value(status: LearnerStatus, exit_code: int | None = None) -> dict[str, Any]:
            history.append([status.value, round(time.time(), 3)])
            return status_value(
                status,
                pid=os.getpid(),  # the guardian's: the "controller" lives as long as it
                start=procs.start_ticks(os.getpid()),
                lease=lease.id,
                generation=spec.generation,
                restart=spec.restart,
                exit_code=exit_code,
                message="",
                time=time.time(),
                history=history,
            )

        def record(status: LearnerStatus, exit_code: int | None = None) -> None:
            etcd.put(key, value(status, exit_code), lease=None if status.final else lease)

        try:
            # Claim the rank as a controller does: create-if-absent under the lease.
            if not etcd.create(key, value(LearnerStatus.STARTING), lease=lease):
                learner.exit_code = int(ExitCode.FATAL)
                return
            record(LearnerStatus.DOWNLOADING)
            record(LearnerStatus.PROCESSING)
            out = Path(spec.learner_dir) / "stdout.log"
            out.parent.mkdir(parents=True, exist_ok=True)
            with out.open("a", encoding="utf-8") as fh:
                for i in range(lines):
                    if learner.stop.wait(seconds / max(lines, 1)):
                        break
                    fh.write(f"step {i + 1} loss {1.0 / (i + 1):.4f}\n")
                    fh.flush()
            until = spec.env.get("SIM_UNTIL_FILE", "")
            if until and not learner.stop.is_set():
                self._wait_until(until, learner)
            if learner.stop.is_set():
                learner.exit_code = int(ExitCode.PREEMPTED)
                record(LearnerStatus.HALTED, learner.exit_code)
            else:
                learner.exit_code = int(ExitCode.OK)
                record(LearnerStatus.COMPLETED, learner.exit_code)
        except Exception as exc:  # an etcd hiccup ends this learner as a failure would
            log.warning("simulated learner %s/%d: %r", spec.job_id, spec.rank, exc)
            learner.exit_code = int(ExitCode.FATAL)
        finally:
            with contextlib.suppress(Exception):
                lease.revoke()

    def _wait_until(self, path: str, learner: _Learner) -> None:
        """Block until `path` exists or the learner is stopped."""
        with self._lock:
            self._until.setdefault(path, []).append(learner)
            if self._poller is None or not self._poller.is_alive():
                self._poller = threading.Thread(target=self._poll, name="sim-until", daemon=True)
                self._poller.start()
        while not learner.released and not learner.stop.is_set():
            learner.wake.wait()
            learner.wake.clear()

    def _poll(self) -> None:
        """Release the learners of each SIM_UNTIL_FILE once it exists; end when none waits."""
        while True:
            with self._lock:
                for path in list(self._until):
                    waiting = [ln for ln in self._until[path] if not ln.stop.is_set()]
                    if waiting and Path(path).exists():
                        for learner in waiting:
                            learner.released = True
                            learner.wake.set()
                        waiting = []
                    if waiting:
                        self._until[path] = waiting
                    else:
                        del self._until[path]
                if not self._until:
                    self._poller = None
                    return
            time.sleep(UNTIL_POLL_S)

    # -- watch and teardown -------------------------------------------------------------
    def learner_exited(self, handle: int) -> int | None:
        with self._lock:
            learner = self._learners.get(handle)
            if learner is None or learner.thread is None or learner.thread.is_alive():
                return None
            del self._learners[handle]
        return learner.exit_code

    def _of(self, job_id: str) -> list[_Learner]:
        with self._lock:
            return [ln for ln in self._learners.values() if ln.job_id == job_id]

    def stop_learners(self, job_id: str, grace_s: float) -> None:
        for learner in self._of(job_id):
            learner.stop.set()
            learner.wake.set()
        deadline = time.monotonic() + grace_s
        for learner in self._of(job_id):
            if learner.thread is not None:
                learner.thread.join(max(0.0, deadline - time.monotonic()))

    def rollback(self, job_id: str, job_dir: str) -> None:
        self.stop_learners(job_id, grace_s=5.0)

    def running(self, job_id: str) -> list[int]:
        return [
            ln.rank for ln in self._of(job_id) if ln.thread is not None and ln.thread.is_alive()
        ]

    def log_tail(self, job_dir: str, rank: int, lines: int = 20) -> list[str]:
        return tail_logs(job_dir, rank, lines)

    @cannot_block  # its own threads, under a lock no call holds across a wait
    def controller_alive(self, job_id: str, rank: int, status: dict[str, Any]) -> bool:
        return any(
            ln.rank == rank and ln.thread is not None and ln.thread.is_alive()
            for ln in self._of(job_id)
        )
