"""A Docker engine (`dockerd`) that Rhizome starts, health-checks and stops by its pid.

The docker backend needs an engine. Where the user already has one, `DOCKER_HOST` names
it and nothing is started. Otherwise — the tests, `rhizome up --embedded --backend docker`
— we run our own `dockerd` under a data directory of its own, like etcd: no systemd, no
bridge and no iptables rules (so it changes nothing on the host's network; learners use
the host network), and stop it by the pid it wrote, never by name.

Only the `dockerd` binary is run as a process; everything said to the engine goes through
the `docker` SDK.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import docker
from docker.errors import DockerException
from requests.exceptions import RequestException

from contract.procs import pid_alive
from services.embedded.process import DependencyError, ManagedServer, ServerInfo

# A unix socket's path must fit `sockaddr_un.sun_path` (108 bytes with the NUL); dockerd
# and its containerd make deeper sockets under the exec root, so keep the data dir short.
MAX_SOCKET_PATH = 100

INSTALL_HINT = (
    "no `dockerd` on PATH: install Debian's engine with `apt-get install docker.io` "
    "(`make install` does it when run as root), or set DOCKER_HOST to an engine you have "
    "(e.g. DOCKER_HOST=unix:///var/run/docker.sock)"
)


def docker_client(url: str, timeout_s: float = 60.0) -> docker.DockerClient:
    """An SDK client for the engine at `url` (`unix:///…/docker.sock` or `tcp://…`)."""
    return docker.DockerClient(base_url=url, timeout=int(timeout_s))


def engine_answers(url: str, timeout_s: float = 2.0) -> bool:
    """Whether the engine at `url` answers `/_ping` within `timeout_s`."""
    try:
        client = docker_client(url, timeout_s)
    except DockerException:
        return False
    try:
        return bool(client.ping())
    except (DockerException, RequestException, OSError):
        return False
    finally:
        client.close()


def mounts_under(root: Path) -> list[str]:
    """Mount points at or below `root` in this mount namespace, deepest first."""
    prefix = str(Path(root).resolve())
    found: list[str] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            if len(fields) < 5:
                continue
            # mountinfo escapes blanks and backslashes in paths as octal (`\\040`).
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return sorted(set(found), key=lambda p: p.count("/"), reverse=True)


class DockerEngine(ManagedServer):
    """`dockerd` under `data_dir` (or, with `DOCKER_HOST`, someone else's engine).

    Layout: `dr/` the data root (images, containers), `ex/` the exec root (containerd's
    state, network namespaces), `docker.sock` the API socket, `dockerd.pid` its pid.
    """

    name = "dockerd"
    # dockerd answers in ~0.2 s here, but its first start sets up overlay2 and containerd.
    start_timeout_s = 60.0

    def __init__(self, data_dir: Path, docker_host: str | None = None) -> None:
        super().__init__(data_dir)
        self.port = 0  # no TCP port: the engine listens on a unix socket only
        host = docker_host if docker_host is not None else os.environ.get("DOCKER_HOST", "")
        self.external_url = host or None

    # -- layout -----------------------------------------------------------------------
    @property
    def external(self) -> bool:
        """True when DOCKER_HOST names an engine we must use and must not start or stop."""
        return self.external_url is not None

    @property
    def socket_path(self) -> Path:
        return self.data_dir / "docker.sock"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "dockerd.pid"

    @property
    def exec_root(self) -> Path:
        return self.data_dir / "ex"

    @property
    def data_root(self) -> Path:
        return self.data_dir / "dr"

    @property
    def url(self) -> str:
        return self.external_url or f"unix://{self.socket_path}"

    def argv(self) -> list[str]:
        dockerd = shutil.which("dockerd") or shutil.which("dockerd", path="/usr/sbin:/sbin")
        if dockerd is None:
            raise DependencyError(INSTALL_HINT)
        return [
            dockerd,
            # No docker0 bridge, no NAT and no iptables rules: the engine must not touch the
            # host's network; containers run with the host network (or none).
            "--bridge=none",
            "--iptables=false",
            "--ip6tables=false",
            "--ip-masq=false",
            f"--data-root={self.data_root}",
            f"--exec-root={self.exec_root}",
            "-H",
            self.url,
            f"--pidfile={self.pid_file}",
        ]

    # -- lifecycle --------------------------------------------------------------------
    def healthy(self) -> bool:
        if not self.external and not self.socket_path.exists():
            return False
        return engine_answers(self.url)

    def client(self, timeout_s: float = 60.0) -> docker.DockerClient:
        """An SDK client for this engine (the caller closes it)."""
        return docker_client(self.url, timeout_s)

    def start(self) -> ServerInfo:
        if self.external:
            if not engine_answers(self.url, timeout_s=5.0):
                raise DependencyError(
                    f"DOCKER_HOST={self.url} does not answer: start that engine, or unset "
                    "DOCKER_HOST to let Rhizome start its own dockerd"
                )
            return ServerInfo(self.name, 0, 0, self.url, "", str(self.data_dir))
        if len(str(self.socket_path.resolve())) > MAX_SOCKET_PATH:
            raise DependencyError(
                f"dockerd: data directory {self.data_dir} is too long for a unix socket "
                f"path (at most {MAX_SOCKET_PATH} bytes); use a short one such as /tmp/rz-docker"
            )
        self.argv()  # DependencyError with the install hint before anything is created
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # A previous engine killed with SIGKILL leaves its socket and mounts; dockerd would
        # refuse the socket ("address already in use") and the mounts would pile up.
        self._unmount_leftovers()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        return super().start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM dockerd alone first: it stops its containers and then its containerd.
        Signalling the whole group at once would kill containerd under a dockerd still
        shutting down. Whatever of the group lingers is then stopped by the shared helper."""
        if self.external:
            return
        pid = self.pid if self.pid is not None else self._pid_from_file()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and pid_alive(pid):
                if self.proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.proc.wait(timeout=0.1)
                else:
                    time.sleep(0.1)
            self.pid = pid
            super().stop(timeout_s=5.0)  # the process group: containerd, if it lingers
        self._unmount_leftovers()

    def kill(self, whole_group: bool = True) -> None:
        super().kill(whole_group)
        if whole_group:  # containerd and the mounts go with the group; else they stay
            self._unmount_leftovers()

    def _pid_from_file(self) -> int | None:
        """The pid dockerd wrote, for a `stop` from another process than `start`'s."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) else None

    def _unmount_leftovers(self) -> None:
        """dockerd leaves `ex/netns/default` (an nsfs mount) behind when it stops, and a
        killed one leaves its containers' overlay mounts too: unmount all under our dir."""
        for point in mounts_under(self.data_dir):
            result = subprocess.run(["umount", point], capture_output=True, text=True)
            if result.returncode != 0:
                # Busy (a process still inside): detach it so the directory can go.
                subprocess.run(["umount", "-l", point], capture_output=True, text=True)
