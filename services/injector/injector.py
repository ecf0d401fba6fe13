"""Schedules of preemptions and the injector that carries them out.

Targets are fixed pids, or a running job's current learners (`targets.JobTargets`: a rank
restarted under new pids is a target again). Each preemption picks one live, not yet doomed
target (seeded), sends SIGTERM to its processes, waits up to `notice_s` for them to leave,
and SIGKILLs those that have not. Preemptions that share a time
(traces remove nodes in bulk) are handled concurrently, one thread each. Every action is
recorded as an `Injection` and, when a log path is given, appended to it as a JSON line.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from contract import procs
from services.injector.targets import InjectorError, PidTargets, Target, Targets
from services.sim import traces


def trace_schedule(
    path: str | Path,
    *,
    time_scale: float = 1.0,
    start_s: float = 0.0,
    job_nodes: int | None = None,
    seed: int = 0,
) -> list[float]:
    """Seconds from now of each `remove` in the trace after `start_s`, divided by
    `time_scale` (a day-long trace at `time_scale=1000` replays in 90 s).

    With `job_nodes`, a removal is the job's only with probability min(1, job_nodes /
    nodes alive) (seeded): the trace is a whole cluster's, the job holds `job_nodes` of its
    nodes. That is the spot simulator's mapping (`services/sim/model.py`), so a replay
    and a simulation of the same trace see the same rate of preemptions."""
    if time_scale <= 0:
        raise InjectorError(f"time_scale must be > 0, got {time_scale}")
    if job_nodes is not None and job_nodes < 1:
        raise InjectorError(f"job_nodes must be >= 1, got {job_nodes}")
    trace = traces.load(path)
    if job_nodes is None:
        return [(e.t_s - start_s) / time_scale for e in trace.removals() if e.t_s >= start_s]
    rng = random.Random(seed)
    return [
        (t - start_s) / time_scale
        for t, alive in trace.removals_with_cluster_size()
        if t >= start_s and rng.random() < min(1.0, job_nodes / alive)
    ]


def exponential_schedule(mttp_s: float, count: int, *, seed: int = 0) -> list[float]:
    """`count` preemption times with exponential inter-arrivals of mean `mttp_s`."""
    if mttp_s <= 0:
        raise InjectorError(f"mttp_s must be > 0, got {mttp_s}")
    if count < 1:
        raise InjectorError(f"count must be >= 1, got {count}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(1.0 / mttp_s)
        out.append(t)
    return out


def alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped by its parent) is gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclass
class Injection:
    """One preemption: when (seconds after start), whom, and how it ended."""

    at_s: float
    pid: int  # the target's first process (0 when nothing ran: outcome "missed")
    notice_s: float
    sigterm_sent: bool = False
    # "exited" (left within the notice), "killed", "gone" (left before the SIGTERM),
    # "missed" (a --job replay: no learner was running, e.g. all were being restarted)
    outcome: str = "pending"
    left_after_s: float | None = None
    events: list[str] = field(default_factory=list)
    rank: int | None = None  # a --job replay: the learner rank preempted
    pids: list[int] = field(default_factory=list)  # every process signalled


class Injector:
    def __init__(
        self,
        targets: list[int] | Targets,
        schedule: list[float],
        *,
        notice_s: float,
        seed: int = 0,
        log_path: Path | None = None,
        poll_s: float = 0.02,
    ) -> None:
        if notice_s < 0:
            raise InjectorError(f"notice must be >= 0 seconds, got {notice_s}")
        self.targets = targets if isinstance(targets, Targets) else PidTargets(list(targets))
        self.schedule = sorted(schedule)
        self.notice_s = notice_s
        self.rng = random.Random(seed)
        self.log_path = log_path
        self.poll_s = poll_s
        self.injections: list[Injection] = []
        # Targets under a preemption now: a second removal must hit another node.
        self._doomed: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def _record(self, inj: Injection) -> None:
        if self.log_path is None:
            return
        with self._lock, open(self.log_path, "a") as fh:
            fh.write(json.dumps(asdict(inj), sort_keys=True) + "\n")

    def _preempt(self, inj: Injection, target: Target) -> None:
        start = time.monotonic()
        # (pid, start time) pairs: a pid reused while we wait is not SIGKILLed.
        refs = [r for r in (procs.ProcRef.of(p) for p in target.pids) if r is not None]
        sent = False
        for ref in refs:
            try:
                os.kill(ref.pid, signal.SIGTERM)
                sent = True
            except ProcessLookupError:
                pass
        if not sent:
            inj.outcome = "gone"
            self._finish(inj, target)
            return
        inj.sigterm_sent = True
        inj.events.append("sigterm")
        deadline = start + self.notice_s
        while time.monotonic() < deadline and any(alive(r.pid) and r.alive() for r in refs):
            time.sleep(self.poll_s)
        survivors = [r for r in refs if alive(r.pid) and r.alive()]
        inj.outcome = "exited"
        for ref in survivors:
            try:
                os.kill(ref.pid, signal.SIGKILL)
                inj.outcome = "killed"
            except ProcessLookupError:
                pass
        if inj.outcome == "killed":
            inj.events.append("sigkill")
        inj.left_after_s = time.monotonic() - start
        self._finish(inj, target)

    def _finish(self, inj: Injection, target: Target) -> None:
        self._record(inj)
        if target.rank is not None:
            # A rank is a slot the guardian refills: its next incarnation is a target again.
            with self._lock:
                self._doomed.discard(target.key)

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> list[Injection]:
        """Carry out the schedule; returns when it is done or no target will come back."""
        t0 = time.monotonic()
        threads = []
        for at in self.schedule:
            wait = t0 + at - time.monotonic()
            if wait > 0 and self._stop.wait(wait):
                break
            with self._lock:
                candidates = [t for t in self.targets.current() if t.key not in self._doomed]
                if not candidates:
                    if not self.targets.refills or self.targets.ended():
                        break
                    missed = Injection(at_s=at, pid=0, notice_s=self.notice_s, outcome="missed")
                    self.injections.append(missed)
                else:
                    missed = None
                    target = self.rng.choice(candidates)
                    self._doomed.add(target.key)
            if missed is not None:
                self._record(missed)
                continue
            inj = Injection(
                at_s=at,
                pid=target.pids[0],
                notice_s=self.notice_s,
                rank=target.rank,
                pids=list(target.pids),
            )
            self.injections.append(inj)
            th = threading.Thread(target=self._preempt, args=(inj, target), daemon=True)
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
        return self.injections
