"""What `rhizome up --embedded --backend docker` adds: an engine and the learner image.

The engine is `DOCKER_HOST`'s when it is set (never started or stopped by us), else our
own `dockerd` under the data directory (`deps/dockerd`, or a short directory under /tmp
when that path is too long for the engine's unix sockets), kept in `platform.json` like
etcd and stopped by its pid on `rhizome down`. The learner image is built offline when
the engine does not have it yet (progress lines; about 40 s the first time on a machine,
seconds after that).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contract.procs import pid_alive
from services.embedded.docker_engine import MAX_SOCKET_PATH, DockerEngine
from services.embedded.process import DependencyError

Progress = Callable[[str], None]
# containerd puts its own sockets a few levels below the exec root: leave room for them.
_ROOM = 40


def engine_dir(wanted: Path) -> Path:
    """`wanted`, or a short stand-in under /tmp named after it when unix sockets below
    it would exceed the kernel's limit."""
    if len(str(wanted / "docker.sock")) + _ROOM <= MAX_SOCKET_PATH:
        return wanted
    digest = hashlib.sha256(str(wanted).encode()).hexdigest()[:10]
    return Path("/tmp") / f"rzd-{digest}"


def ensure_engine(wanted: Path, processes: dict[str, dict[str, Any]], progress: Progress) -> str:
    """The engine's URL, after making sure it answers and has the learner image."""
    from services.images.build import ImageBuildError, build_offline, image_exists, learner_tag

    external = os.environ.get("DOCKER_HOST", "")
    kept = processes.get("dockerd")
    if external:
        engine = DockerEngine(wanted, docker_host=external)
        engine.start()  # checks that it answers; starts nothing
        progress(f"using the Docker engine at DOCKER_HOST={external}")
    elif kept and pid_alive(int(kept["pid"])):
        engine = DockerEngine(Path(kept["dir"]), docker_host="")
    else:
        directory = engine_dir(wanted)
        engine = DockerEngine(directory, docker_host="")
        progress(f"starting dockerd under {directory} ...")
        info = engine.start()
        processes["dockerd"] = {"pid": info.pid, "log": info.log_path, "dir": str(directory)}
        progress(f"dockerd is healthy ({engine.url}, log {info.log_path})")
    started = "dockerd" in processes and processes["dockerd"] is not kept
    client = engine.client()
    try:
        tag = learner_tag()
        if image_exists(client, tag):
            progress(f"learner image {tag} is in the engine")
        else:
            progress(f"building the learner image {tag} offline (first time: about 40 s)")
            try:
                result = build_offline(client, progress)
                progress(f"built {result.tag} in {result.seconds:.1f} s")
            except ImageBuildError as exc:
                problem = str(exc)
            else:
                problem = ""
            if problem:
                if started:  # leave nothing running that platform.json does not record
                    engine.stop()
                    processes.pop("dockerd", None)
                raise DependencyError(f"cannot build the learner image: {problem}")
    finally:
        client.close()
    return engine.url


def stop_engine(process: dict[str, Any], progress: Progress) -> None:
    """Stop the dockerd `up` started, by its pid (it stops its containers), and unmount."""
    engine = DockerEngine(Path(process["dir"]), docker_host="")
    progress(f"stopping dockerd (pid {process['pid']}) ...")
    engine.pid = int(process["pid"]) if pid_alive(int(process["pid"])) else None
    engine.stop()
