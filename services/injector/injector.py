"""Schedules of preemptions and the injector that carries them out on pids.

Each preemption picks one live, not yet doomed target (seeded), sends SIGTERM, waits up to
`notice_s` for it to leave, and SIGKILLs it if it has not. Preemptions that share a time
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

from services.sim import traces


class InjectorError(ValueError):
    """Bad injector input (no targets, a bad rate, an unreadable trace)."""


def trace_schedule(
    path: str | Path, *, time_scale: float = 1.0, start_s: float = 0.0
) -> list[float]:
    """Seconds from now of each `remove` in the trace after `start_s`, divided by
    `time_scale` (a day-long trace at `time_scale=1000` replays in 90 s)."""
    if time_scale <= 0:
        raise InjectorError(f"time_scale must be > 0, got {time_scale}")
    trace = traces.load(path)
    return [(e.t_s - start_s) / time_scale for e in trace.removals() if e.t_s >= start_s]


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
    pid: int
    notice_s: float
    sigterm_sent: bool = False
    outcome: str = "pending"  # "exited" (left within the notice), "killed", "gone"
    left_after_s: float | None = None
    events: list[str] = field(default_factory=list)


class Injector:
    def __init__(
        self,
        pids: list[int],
        schedule: list[float],
        *,
        notice_s: float,
        seed: int = 0,
        log_path: Path | None = None,
        poll_s: float = 0.02,
    ) -> None:
        if not pids:
            raise InjectorError("no target pids: pass --pid for each learner process")
        if notice_s < 0:
            raise InjectorError(f"notice must be >= 0 seconds, got {notice_s}")
        self.pids = list(pids)
        self.schedule = sorted(schedule)
        self.notice_s = notice_s
        self.rng = random.Random(seed)
        self.log_path = log_path
        self.poll_s = poll_s
        self.injections: list[Injection] = []
        self._doomed: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def _record(self, inj: Injection) -> None:
        if self.log_path is None:
            return
        with self._lock, open(self.log_path, "a") as fh:
            fh.write(json.dumps(asdict(inj), sort_keys=True) + "\n")

    def _preempt(self, inj: Injection) -> None:
        start = time.monotonic()
        try:
            os.kill(inj.pid, signal.SIGTERM)
            inj.sigterm_sent = True
            inj.events.append("sigterm")
        except ProcessLookupError:
            inj.outcome = "gone"
            self._record(inj)
            return
        deadline = start + self.notice_s
        while time.monotonic() < deadline and alive(inj.pid):
            time.sleep(self.poll_s)
        if alive(inj.pid):
            try:
                os.kill(inj.pid, signal.SIGKILL)
                inj.events.append("sigkill")
                inj.outcome = "killed"
            except ProcessLookupError:
                inj.outcome = "exited"
        else:
            inj.outcome = "exited"
        inj.left_after_s = time.monotonic() - start
        self._record(inj)

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> list[Injection]:
        """Carry out the schedule; returns when it is done or every target is gone."""
        t0 = time.monotonic()
        threads = []
        for at in self.schedule:
            wait = t0 + at - time.monotonic()
            if wait > 0 and self._stop.wait(wait):
                break
            with self._lock:
                candidates = [p for p in self.pids if p not in self._doomed and alive(p)]
                if not candidates:
                    break
                pid = self.rng.choice(candidates)
                self._doomed.add(pid)
            inj = Injection(at_s=at, pid=pid, notice_s=self.notice_s)
            self.injections.append(inj)
            th = threading.Thread(target=self._preempt, args=(inj,), daemon=True)
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
        return self.injections
