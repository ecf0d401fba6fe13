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

from contract.procs import free_port, stop_process_group


class DependencyError(RuntimeError):
    """A dependency did not come up; the message names it and its log file."""


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
                raise DependencyError(
                    f"{self.name} exited with code {self.proc.returncode} while starting; "
                    f"see its log: {self.log_path}"
                )
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

    def kill(self) -> None:
        """SIGKILL the server and its children at once (for chaos tests)."""
        if self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)
        self.pid = None
