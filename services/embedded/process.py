"""A server process Rhizome starts, health-checks and stops by its process id.

Every embedded dependency (etcd, the MongoDB-wire server, the Elasticsearch-API
server) and every test fixture goes through this one class, so that all of them
bind 127.0.0.1 on a free port, keep their data in a directory of their own, log to
a file, and are stopped by pid — never by name.
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from contract.procs import free_port, port_free, stop_process_group
from contract.status import ExitCode

# How often a server whose port was taken while it started is started again on others.
PORT_TRIES = 3


class DependencyError(RuntimeError):
    """A dependency did not come up; the message names it and its log file."""


class PortTaken(DependencyError):
    """The server exited while starting because a port it was to listen on was taken."""


@dataclass
class ServerInfo:
    """What a started server leaves in its state file, so another process can stop it."""

    name: str
    pid: int
    port: int
    url: str
    log_path: str
    data_dir: str


class ManagedServer(abc.ABC):
    """One server process in its own session (so its children die with it)."""

    name: str = "server"
    start_timeout_s: float = 30.0

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.data_dir = Path(data_dir)
        # A port is picked free some time before the server binds it, and another process
        # can take it in between (seen in `make test`). Ports picked here may be picked
        # again (`repick_ports`); a caller that picked its own sets this when it may too.
        self.repick = not port
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None

    # -- what each server says about itself ---------------------------------------
    @abc.abstractmethod
    def argv(self) -> list[str]: ...

    @property
    @abc.abstractmethod
    def url(self) -> str: ...

    @abc.abstractmethod
    def healthy(self) -> bool: ...

    def listen_ports(self) -> list[int]:
        """Every port the server binds (to tell whether one was taken)."""
        return [self.port]

    def repick_ports(self) -> None:
        """Pick other free ports after one was taken (only called when `repick`)."""
        self.port = free_port()

    def environ(self) -> dict[str, str]:
        """Variables the process gets on top of ours: where a setting is a secret (a store
        URI with a password, a credentials file), since `/proc/PID/cmdline` is readable
        by every local user and `/proc/PID/environ` only by the process's own uid."""
        return {}

    # -- shared mechanics -----------------------------------------------------------
    @property
    def log_path(self) -> Path:
        return self.data_dir / f"{self.name}.log"

    @property
    def state_path(self) -> Path:
        return self.data_dir / f"{self.name}.json"

    def start(self) -> ServerInfo:
        """Start the server and wait until it is healthy; when it exits because a port was
        taken and its ports may be picked again, start it on others (PORT_TRIES in all)."""
        for attempt in range(1, PORT_TRIES + 1):
            try:
                return self._start_once()
            except PortTaken:
                if not self.repick or attempt == PORT_TRIES:
                    raise
                self.repick_ports()
        raise AssertionError("unreachable: the last try returns or raises")

    def _start_once(self) -> ServerInfo:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it after Popen
        try:
            self.proc = subprocess.Popen(
                self.argv(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.data_dir,
                env={**os.environ, **self.environ()},
                start_new_session=True,
            )
        except FileNotFoundError as exc:
            raise DependencyError(
                f"{self.name}: cannot start {self.argv()[0]!r} ({exc}); run `make install`"
            ) from exc
        finally:
            log.close()
        self.pid = self.proc.pid
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._start_failure(self.proc.returncode)
            if self.healthy():
                info = self.info()
                self.state_path.write_text(json.dumps(info.__dict__))
                return info
            time.sleep(0.1)
        self.stop()
        raise DependencyError(
            f"{self.name} did not become healthy within {self.start_timeout_s:.0f}s "
            f"on 127.0.0.1:{self.port}; see its log: {self.log_path}"
        )

    def _start_failure(self, code: int) -> DependencyError:
        """Why the server exited while starting: `PortTaken` when it says so (our daemon's
        own exit code) or, for a server that does not, when one of its ports is held by
        another process now."""
        taken = [p for p in self.listen_ports() if not port_free(p)]
        if code == ExitCode.PORT_IN_USE or taken:
            # Its children, if any, go too: the next try must not find them on a port.
            if self.pid is not None:
                stop_process_group(self.pid, 5)
            ports = ", ".join(str(p) for p in taken or self.listen_ports())
            return PortTaken(
                f"{self.name} exited with code {code} while starting: a port it was to "
                f"listen on ({ports}) is in use; see its log: {self.log_path}"
            )
        return DependencyError(
            f"{self.name} exited with code {code} while starting; see its log: {self.log_path}"
        )

    def info(self) -> ServerInfo:
        assert self.pid is not None
        return ServerInfo(
            self.name, self.pid, self.port, self.url, str(self.log_path), str(self.data_dir)
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.pid is None:
            return
        stop_process_group(self.pid, timeout_s)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=1)
        with contextlib.suppress(FileNotFoundError):
            self.state_path.unlink()
        self.pid = None

    def kill(self, whole_group: bool = True) -> None:
        """SIGKILL the server and its children at once (for chaos tests), and reap it.
        `whole_group=False`: the server's process alone, as a crash of it would leave its
        children (a daemon's guardians live on); its pid is kept, so `stop` still ends
        what is left of its process group."""
        if self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            if whole_group:
                os.killpg(self.pid, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)
        if whole_group:
            self.pid = None
