"""Session fixtures for the docker tests: a real engine and the offline learner image.

The engine is a `dockerd` started on a fresh, short /tmp directory (unix socket paths are
limited to ~107 bytes) and stopped by its pid at the end of the session, also when tests
fail; `DOCKER_HOST` selects an engine of yours instead and nothing is started. Without
either the fixture FAILS: a docker test that silently skips would hide a platform that
cannot run containers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import pytest

from services.embedded.docker_engine import DockerEngine
from services.embedded.process import DependencyError
from services.images.build import (
    BuildResult,
    ImageBuildError,
    _rootfs_tarball,
    _tarball_name,
    build_offline,
    cache_dir,
)

HOW_TO_PROVIDE = (
    "the docker tests need a Docker engine: run `make install` as root (it installs "
    "Debian's docker.io; the tests then start dockerd themselves), or set DOCKER_HOST to "
    "a running engine"
)


def remove_engine_root(data_dir: Path) -> None:
    """Remove an engine's data root we created, in a detached `rm`: the tree (a Debian
    root filesystem and the learner image's layers, about 8,000 files) took 10-28 s to
    remove in-line. `--one-file-system` leaves alone anything still mounted beneath it."""
    subprocess.Popen(
        ["rm", "-rf", "--one-file-system", str(data_dir)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


# The learner base's root filesystem, debootstrapped in the background while the tests
# that run before the docker ones go on (see pytest_collection_finish); None when the run
# needs no debootstrap; and the progress lines it printed.
_ROOTFS_AHEAD: threading.Thread | None = None
_AHEAD_LINES: list[str] = []


def _debootstrap_ahead() -> None:
    try:
        _rootfs_tarball(_AHEAD_LINES.append)
    except Exception as exc:
        # build_offline meets the missing tarball and runs debootstrap itself, failing the
        # learner_image fixture with its own message; this thread only tried to be early.
        _AHEAD_LINES.append(f"debootstrap ahead of the docker tests failed: {exc}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start debootstrap as soon as the run is known to hold docker tests and no cached
    root filesystem exists (a fresh machine, as on CI): it costs about a minute, mostly
    waiting on Debian's mirror, that the session's first learner image build would
    otherwise wait out while every docker test waits behind it. Our own engine is fresh
    each session, so only the cache can spare it; an engine of yours (DOCKER_HOST) may
    already hold the base, and then nothing is started here."""
    global _ROOTFS_AHEAD
    if not any(item.get_closest_marker("docker") for item in session.items):
        return
    if os.environ.get("DOCKER_HOST") or os.geteuid() != 0:
        return
    if (cache_dir() / _tarball_name()).exists():
        return
    if shutil.which("debootstrap", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None:
        return
    _ROOTFS_AHEAD = threading.Thread(
        target=_debootstrap_ahead, name="debootstrap-ahead", daemon=True
    )
    _ROOTFS_AHEAD.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A run that ended before its docker tests (-x, an interrupt) still waits for the
    debootstrap it started: stopped half-way it would leave a running process and a
    half-made root filesystem in the cache directory."""
    if _ROOTFS_AHEAD is not None:
        _ROOTFS_AHEAD.join()


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[DockerEngine]:
    """A running engine: our own dockerd (stopped by pid afterwards) or DOCKER_HOST's."""
    data_dir = Path(tempfile.mkdtemp(prefix="rzd-", dir="/tmp"))
    engine = DockerEngine(data_dir)
    problem = ""
    try:
        engine.start()
    except DependencyError as exc:
        problem = str(exc)
    if problem:  # failed outside the `except`, so the report is one message, not a chain
        engine.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
        pytest.fail(f"{HOW_TO_PROVIDE} ({problem})", pytrace=False)
    try:
        yield engine
    finally:
        engine.stop()
        if not engine.external:
            remove_engine_root(data_dir)


@pytest.fixture(scope="session")
def docker_client(docker_engine: DockerEngine) -> Iterator[docker.DockerClient]:
    client = docker_engine.client()
    yield client
    client.close()


@dataclass
class LearnerImage:
    """The built image and the progress lines its build printed."""

    result: BuildResult
    progress: list[str] = field(default_factory=list)

    @property
    def tag(self) -> str:
        return self.result.tag


@pytest.fixture(scope="session")
def learner_image(docker_client: docker.DockerClient) -> LearnerImage:
    """`rhizome-learner:<version>` built offline once per session. On a fresh engine the
    base comes from the cached root filesystem, or from debootstrap the first time."""
    if _ROOTFS_AHEAD is not None:
        _ROOTFS_AHEAD.join()  # its tarball is what build_offline imports
    lines = list(_AHEAD_LINES)
    try:
        return LearnerImage(build_offline(docker_client, lines.append), lines)
    except ImageBuildError as exc:
        problem = str(exc)
    pytest.fail(f"building the learner image failed: {problem}", pytrace=False)


class DockerPlatform:
    """`rhizomed --backend docker` (api + lcm, and the TDS given an Elasticsearch URL) as
    `rhizome up` runs it, on the session's engine, etcd and MongoDB; restartable on the
    same ports after a SIGKILL. With the TDS, each job's log collector ships the
    containers' output there (the only place it is kept once the containers are gone)."""

    def __init__(
        self, data_dir: Path, etcd_url: str, mongo_url: str, engine_url: str, es_url: str = ""
    ) -> None:
        from contract.procs import free_port

        self.data_dir = data_dir
        self.engine_url = engine_url
        self.port, self.rest = free_port(), free_port()
        self.args = [
            f"--mongodb-uri={mongo_url}",
            f"--etcd={etcd_url}",
            "--services=api,lcm" + (",tds" if es_url else ""),
            "--backend=docker",
            f"--docker-host={engine_url}",
            f"--admin-token-file={data_dir / 'admin.token'}",
        ]
        if es_url:
            self.args.append(f"--elasticsearch-url={es_url}")
        self.server: Any = None
        self.started = False  # once started, a restart keeps the ports

    def learner_output(self, job_id: str, rank: int = 0, stream: str = "stdout") -> str:
        """What learner `rank` printed on `stream`, as the TDS holds it (shipped by the
        job's log collector from its containers' streams, before the job ended)."""
        from rhizome.v1 import tds_pb2

        from services.client.sdk import Client

        with Client(self.address, token=self.token()) as client:
            lines = client.logs(tds_pb2.LogsRequest(job_id=job_id, learner=rank))
            return "".join(f"{ln.line}\n" for ln in lines if ln.stream == stream)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def token(self) -> str:
        """The admin token the daemon wrote on its first start (as `rhizome up` does)."""
        return (self.data_dir / "admin.token").read_text().strip()

    def start(self, **env: str) -> None:
        import os

        from services.embedded.platform import DaemonServer

        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the daemon and its guardians inherit them
        try:
            self.server = DaemonServer(self.data_dir, self.port, self.rest, self.args)
            # A first start may replace ports taken before the daemon binds them
            # (ManagedServer.start); a restart keeps its ports: its clients know them.
            self.server.repick = not self.started
            self.server.start()
            self.port, self.rest = self.server.port, self.server.rest_port
            self.started = True
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def kill(self) -> None:
        import os
        import signal

        assert self.server is not None and self.server.pid is not None
        os.kill(self.server.pid, signal.SIGKILL)
        assert self.server.proc is not None
        self.server.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(timeout_s=30)


@pytest.fixture(scope="module")
def docker_platform(
    etcd_server: Any,
    mongo_server: Any,
    es_server: Any,
    docker_engine: DockerEngine,
    learner_image: LearnerImage,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[DockerPlatform]:
    with started_platform(
        Path(tmp_path_factory.mktemp("dockerplatform")),
        etcd_server,
        mongo_server,
        es_server,
        docker_engine,
    ) as platform:
        yield platform


@contextlib.contextmanager
def started_platform(
    data_dir: Path,
    etcd_server: Any,
    mongo_server: Any,
    es_server: Any,
    docker_engine: DockerEngine,
    args: Sequence[str] = (),
    **env: str,
) -> Iterator[DockerPlatform]:
    """A DockerPlatform with the TDS on the session's servers, more daemon flags in `args`,
    started with a 3 s learner grace, 2 deploy attempts and `env`; stopped at the end."""
    platform = DockerPlatform(
        data_dir, etcd_server.url, mongo_server.url, docker_engine.url, es_server.url
    )
    platform.args += args
    platform.start(RHIZOME_LEARNER_GRACE_S="3", RHIZOME_DEPLOY_ATTEMPTS="2", **env)
    try:
        yield platform
    finally:
        platform.stop()
