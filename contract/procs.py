"""Process helpers both sides use: free ports, liveness, process groups, job labels.

Every learner process carries its job in its environment (`RHIZOME_JOB_ID`, `RHIZOME_RANK`,
`RHIZOME_ROLE`, see `contract.env.labels`): that is the label by which a rollback or a
teardown finds *everything* of a job, even processes whose parent died and whose pid was
never written down. A pid alone is not an identity (pids are reused), so a reference is
(pid, start time).

On this kind of machine PID 1 may not reap orphans, so every supervisor in the chain
(daemon, guardian, controller) makes itself a child subreaper and reaps what lands on it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from contract import env as learner_env
from contract.env import Role

_PR_SET_CHILD_SUBREAPER = 36


# Listening ports are picked below the kernel's ephemeral range. A port got by binding
# port 0 comes from that range, where every outgoing connection of every process also takes
# its local port: between choosing such a port and the server binding it (seconds, when
# other servers start first), a client connection could take it, and the server failed
# with "address already in use" (seen in `make test`). Below the range only another
# listener can take it, and a random pick makes two pickers unlikely to agree.
_LOWEST_LISTEN_PORT = 10000
_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PICKS = 64
_port_random = random.Random()  # its own: a test seeding `random` must not align pickers


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default if it
    does not say)."""
    try:
        low, high = (int(x) for x in _EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def port_free(port: int) -> bool:
    """Whether nobody listens on (or holds) `port` on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class PortInUse(RuntimeError):
    """A listener could not bind its address because another process holds the port."""


def listen_failure(what: str, address: str) -> RuntimeError:
    """The error for `what` that could not listen on `address` (host:port): `PortInUse` when
    another process holds the port now, so that whoever picked it can pick another, else a
    plain error (a bad host, a privileged port)."""
    port = int(address.rpartition(":")[2] or 0)
    if port and not port_free(port):
        return PortInUse(f"{what} could not listen on {address}: the port is in use")
    return RuntimeError(f"{what} could not listen on {address}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now, below the ephemeral range
    where there is room (see above), else any the kernel gives."""
    below = ephemeral_port_range()[0] - 1
    if below - _LOWEST_LISTEN_PORT >= 1000:
        for _ in range(_PICKS):
            port = _port_random.randint(_LOWEST_LISTEN_PORT, below)
            if port_free(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def venv_bin(name: str) -> str:
    """The path of an executable installed beside this interpreter (else the bare name,
    for PATH)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not: it still answers kill(0))."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return None  # a zombie is dead for every purpose here
    return int(fields[19])


@dataclass(frozen=True)
class ProcRef:
    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> ProcRef | None:
        ticks = start_ticks(pid)
        return cls(pid, ticks) if ticks is not None else None

    def alive(self) -> bool:
        return self.pid > 0 and start_ticks(self.pid) == self.start


def ref_alive(pid: object, start: object) -> bool:
    """Liveness from a (pid, start) pair read out of etcd or a state file."""
    if not isinstance(pid, int) or not isinstance(start, int) or pid <= 0:
        return False
    return ProcRef(pid, start).alive()


def _environ(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key.startswith(learner_env.PREFIX.encode()):
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def labelled(job_id: str, rank: int | None = None, role: Role | None = None) -> list[int]:
    """Pids of live processes labelled with this job (and rank / role when given)."""
    me = os.getpid()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid == me:
            continue
        env = _environ(pid)
        if not env or env.get(learner_env.JOB_ID) != job_id:
            continue
        if rank is not None and env.get(learner_env.RANK) != str(rank):
            continue
        if role is not None and env.get(learner_env.ROLE) != role.value:
            continue
        if start_ticks(pid) is not None:
            found.append(pid)
    return found


def _signal_all(pids: Iterable[int], sig: int) -> None:
    own_group = os.getpgid(0)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            pgid = os.getpgid(pid)
            if pgid != own_group:
                os.killpg(pgid, sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def kill_labelled(
    job_id: str,
    rank: int | None = None,
    role: Role | None = None,
    grace_s: float = 0.0,
    timeout_s: float = 10.0,
) -> int:
    """Stop every process labelled with the job: SIGTERM and `grace_s` to save and leave,
    then SIGKILL, until none is left (they may fork meanwhile). Returns how many were seen."""
    pids = labelled(job_id, rank, role)
    seen = set(pids)
    if pids and grace_s > 0:
        _signal_all(pids, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
            pids = labelled(job_id, rank, role)
            seen.update(pids)
            if not pids:
                return len(seen)
    deadline = time.monotonic() + timeout_s
    while pids and time.monotonic() < deadline:
        _signal_all(pids, signal.SIGKILL)
        time.sleep(0.02)
        pids = labelled(job_id, rank, role)
        seen.update(pids)
    return len(seen)


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs. Zombies do not count: an orphan's
    zombie lingers until PID 1 reaps it, which some containers' PID 1 never does."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Zombies still count for killpg(0); look for a member that is not one.
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def stop_process_group(pid: int, timeout_s: float = 10.0) -> None:
    """SIGTERM the process group led by `pid`, then SIGKILL it if it lingers."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        if not pid_alive(pid) and not group_alive(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def become_subreaper() -> bool:
    """Orphans of our descendants are re-parented to us (and reaped by `Reaper`)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


class Reaper:
    """Reaps every child of this process (our own and adopted orphans) and reports the
    exit status of those someone asked about. Do not use `Popen.wait/poll` alongside it."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._status: dict[int, int] = {}
        self._callbacks: dict[int, Callable[[int, int], None]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reaper", daemon=True)

    def start(self) -> Reaper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def watch(self, pid: int, callback: Callable[[int, int], None]) -> None:
        """Call `callback(pid, exit_code)` once `pid` (a child of ours) has exited."""
        with self._lock:
            if pid in self._status:
                code = self._status.pop(pid)
            else:
                self._callbacks[pid] = callback
                return
        callback(pid, code)

    def exit_code(self, pid: int) -> int | None:
        with self._lock:
            return self._status.get(pid)

    def reap_once(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            with self._lock:
                callback = self._callbacks.pop(pid, None)
                if callback is None:
                    self._status[pid] = code
                    if len(self._status) > 10_000:  # orphans nobody asks about
                        self._status.pop(next(iter(self._status)))
            if callback is not None:
                with contextlib.suppress(Exception):
                    callback(pid, code)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.reap_once()
