"""The supervisor of `rhizome up`: restarts a platform process that died (issue #15).

`rhizome up` starts the embedded servers and the daemon, records in
`<data_dir>/platform.json` each one's pid and how it was started (argv, working directory,
log file), then starts this process (`python -m services.embedded.supervisor`), in a
session of its own, with its log in `<data_dir>/supervisor.log`. Every `poll_s` it checks
each recorded pid; a dead process is started again with the same command line after a
backoff that doubles with each restart (0.5 s up to `max_backoff_s`) and resets once the
process has stayed up for `stable_s`. Each restart is logged, counted in
`platform.json` (`restarts`) and in `rhizome_supervised_restarts_total{process}` on the
supervisor's metrics address (`rhizome status`). A restarted daemon re-reads the queue
and re-adopts the running guardians, so its jobs carry on.

`rhizome down` stops the supervisor first (SIGTERM, by pid), then the processes, so
nothing it stops is started again; the supervisor also leaves by itself once
`platform.json` lists no processes.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.procs import pid_alive

log = logging.getLogger("rhizome.supervisor")

LOCK_FILE = "platform.lock"
LOG_FILE = "supervisor.log"


@contextlib.contextmanager
def state_lock(data_dir: Path) -> Iterator[None]:
    """Serialises read-modify-write of platform.json between up, down and the supervisor."""
    with open(Path(data_dir) / LOCK_FILE, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def restart_recipe(
    argv: list[str], cwd: Path, log_path: Path, environ: dict[str, str] | None = None
) -> dict[str, Any]:
    """What the supervisor needs to start a process again, kept beside its pid: `environ`
    holds the variables it got on top of `up`'s environment (`ManagedServer.environ`)."""
    recipe: dict[str, Any] = {"argv": list(argv), "cwd": str(cwd), "log": str(log_path)}
    if environ:
        recipe["env"] = dict(environ)
    return recipe


@dataclass
class Backoff:
    """When a dead process may be started again."""

    initial_s: float = 0.5
    max_s: float = 30.0
    stable_s: float = 30.0
    delay_s: dict[str, float] = field(default_factory=dict)
    due: dict[str, float] = field(default_factory=dict)
    started: dict[str, float] = field(default_factory=dict)

    def alive(self, name: str, now: float) -> None:
        self.due.pop(name, None)
        if now - self.started.get(name, now) >= self.stable_s:
            self.delay_s[name] = self.initial_s

    def dead(self, name: str, now: float) -> float | None:
        """Seconds to wait before the restart, on first sight of the death; else None."""
        if name in self.due:
            return None
        delay = self.delay_s.get(name, self.initial_s)
        self.due[name] = now + delay
        return delay

    def ready(self, name: str, now: float) -> bool:
        return name in self.due and now >= self.due[name]

    def restarted(self, name: str, now: float) -> None:
        self.due.pop(name, None)
        self.started[name] = now
        self.delay_s[name] = min(self.delay_s.get(name, self.initial_s) * 2, self.max_s)


class Supervisor:
    def __init__(self, data_dir: Path, poll_s: float = 0.5, backoff: Backoff | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.poll_s = poll_s
        self.backoff = backoff or Backoff()
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.stop = threading.Event()

    def alive(self, name: str, pid: int) -> bool:
        child = self.children.get(name)
        if child is not None and child.pid == pid:
            return child.poll() is None  # ours: poll also reaps it
        return pid_alive(pid)

    def run(self) -> int:
        from services.embedded.platform import load_state

        log.info("supervising the platform in %s", self.data_dir)
        while not self.stop.is_set():
            state = load_state(self.data_dir)
            if state is None or not state.processes:
                log.info("no platform processes left (rhizome down); leaving")
                return 0
            now = time.monotonic()
            for name, proc in state.processes.items():
                if "argv" not in proc:
                    continue  # not started by a recipe (the Docker engine): not ours
                pid = int(proc["pid"])
                if self.alive(name, pid):
                    self.backoff.alive(name, now)
                    continue
                delay = self.backoff.dead(name, now)
                if delay is not None:
                    code = self._exit_code(name, pid)
                    log.warning(
                        "%s (pid %d) died%s; restarting it in %.1fs", name, pid, code, delay
                    )
                if self.backoff.ready(name, now):
                    self._restart(name)
            self.stop.wait(self.poll_s)
        log.info("stopped (rhizome down)")
        return 0

    def _exit_code(self, name: str, pid: int) -> str:
        child = self.children.get(name)
        if child is not None and child.pid == pid and child.returncode is not None:
            return f" with exit code {child.returncode}"
        return ""

    def _restart(self, name: str) -> None:
        from services.embedded.platform import load_state, save_state
        from services.metrics import SUPERVISED_RESTARTS

        with state_lock(self.data_dir):
            if self.stop.is_set():
                return  # down is under way: start nothing
            state = load_state(self.data_dir)
            if state is None or name not in state.processes:
                return
            proc = state.processes[name]
            if self.alive(name, int(proc["pid"])):
                return  # someone (rhizome up) started it meanwhile
            try:
                with open(proc["log"], "ab") as out:
                    child = subprocess.Popen(
                        proc["argv"],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        cwd=proc["cwd"],
                        env={**os.environ, **proc.get("env", {})},
                        start_new_session=True,
                    )
            except OSError as exc:
                log.error("cannot restart %s: %s; trying again later", name, exc)
                self.backoff.restarted(name, time.monotonic())
                return
            self.children[name] = child
            old = proc["pid"]
            proc["pid"] = child.pid
            proc["restarts"] = int(proc.get("restarts", 0)) + 1
            save_state(state)
        self.backoff.restarted(name, time.monotonic())
        SUPERVISED_RESTARTS.labels(process=name).inc()
        log.warning(
            "restarted %s: pid %s -> %d (restart %d; log %s)",
            name,
            old,
            child.pid,
            proc["restarts"],
            proc["log"],
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.embedded.supervisor")
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--metrics-address", default="", help="HOST:PORT for /metrics")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between checks")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s supervisor: %(message)s"
    )
    supervisor = Supervisor(args.data_dir, poll_s=args.poll)

    def on_term(*_: object) -> None:
        supervisor.stop.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    if args.metrics_address:
        from services.config import split_address
        from services.metrics import serve_metrics

        host, port = split_address(args.metrics_address)
        serve_metrics(port, host)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
