"""`rhizome image build`: the learner image, `rhizome-learner:<version>`.

Two routes to the same contract (a non-root uid 10001, `python -m learner.controller`):

- **registry**: `deploy/docker/Dockerfile.learner`, from an official `python` base with the
  pinned requirements and the code baked in. Needs a registry to pull the base from.
- **offline** (what the tests use; the default when no registry answers): a Debian
  bookworm root filesystem made by `debootstrap --variant=minbase` (Debian's package
  mirror is reachable where a container registry is not), imported as
  `rhizome-learner-base:bookworm-ssl` (minbase plus libssl3 and ca-certificates), plus a tiny `docker build` layer for the user, labels
  and the command. Python, the virtualenv and the source are *not* baked in: the platform
  bind-mounts them read-only at the same paths at run time (`learner_mounts()`), which is
  seconds instead of minutes and gigabytes. The image is therefore tied to this checkout
  and its labels say which paths it expects.

The slow step is debootstrap (~30 s). It is skipped when the engine already has the base
image, and also when a previous build left the root filesystem's tarball in the cache
directory (a fresh engine — each test session starts one — then imports it in seconds).

Only `debootstrap` and `tar` run as processes; everything said to the engine goes through
the `docker` SDK.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, DockerException, ImageNotFound
from docker.types import Mount
from requests.exceptions import RequestException

import services
from services.embedded.docker_engine import INSTALL_HINT as DOCKERD_INSTALL_HINT

Progress = Callable[[str], None]

REPO_ROOT = Path(services.__file__).resolve().parents[1]
LEARNER_REPOSITORY = "rhizome-learner"
BASE_IMAGE = "rhizome-learner-base:bookworm-ssl"
# Beyond minbase: the TLS library the mounted Python's `ssl` module links against, and the
# CA bundle, so learners reach an object store (boto3) and any HTTPS endpoint.
BASE_PACKAGES = ("libssl3", "ca-certificates")
SUITE = "bookworm"
LEARNER_UID = 10001
LEARNER_USER = "rhizome"
LEARNER_HOME = "/home/rhizome"
DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# Where the official base images come from: if it does not answer, build offline.
DEFAULT_REGISTRY = ("registry-1.docker.io", 443)
LABEL_PREFIX = "org.rhizome"


class ImageBuildError(RuntimeError):
    """An expected failure of `rhizome image build`; the message is one line for the user."""


class EngineUnreachable(ImageBuildError):
    pass


@dataclass
class BuildResult:
    image_id: str
    tag: str
    route: str  # "offline" or "registry"
    base: str  # how the base was obtained: "engine", "cache", "debootstrap" or "registry"
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def learner_tag(version: str = services.__version__) -> str:
    return f"{LEARNER_REPOSITORY}:{version}"


def cache_dir() -> Path:
    """Where the debootstrapped root filesystem's tarball is kept between engines."""
    env = os.environ.get("RHIZOME_IMAGE_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "rhizome" / "images"


# -- the engine ------------------------------------------------------------------------
def engine_url(docker_host: str | None = None) -> str:
    return docker_host or os.environ.get("DOCKER_HOST") or DEFAULT_DOCKER_HOST


def connect(docker_host: str | None = None, timeout_s: float = 600.0) -> docker.DockerClient:
    """A client for the engine, or EngineUnreachable saying which one and how to get one."""
    url = engine_url(docker_host)
    hint = (
        f"no Docker engine answers at {url}: start one with "
        "`rhizome up --embedded --backend docker` (which runs dockerd under the data "
        "directory), or point DOCKER_HOST at a running engine"
    )
    if shutil.which("dockerd") is None and shutil.which("dockerd", path="/usr/sbin") is None:
        hint += f"; {DOCKERD_INSTALL_HINT}"
    try:
        client = docker.DockerClient(base_url=url, timeout=int(timeout_s))
    except DockerException as exc:
        raise EngineUnreachable(f"{hint} ({exc})") from exc
    try:
        client.ping()
    except (DockerException, RequestException, OSError) as exc:
        client.close()
        raise EngineUnreachable(hint) from exc
    return client


def registry_reachable(address: tuple[str, int] = DEFAULT_REGISTRY, timeout_s: float = 3.0) -> bool:
    """Whether the registry's port answers; a cheap stand-in for a pull that would hang."""
    try:
        with socket.create_connection(address, timeout=timeout_s):
            return True
    except OSError:
        return False


def image_exists(client: docker.DockerClient, name: str) -> str | None:
    try:
        return str(client.images.get(name).id)
    except ImageNotFound:
        return None


# -- run-time mounts ---------------------------------------------------------------------
def learner_mounts() -> list[Mount]:
    """What a container from the offline image needs bind-mounted, read-only, at the same
    paths: the Python install (a venv's `python` is a symlink into it), the virtualenv,
    and the source tree (the editable install's `.pth` files point into it)."""
    paths = [
        Path(sys.base_prefix).resolve(),
        Path(sys.prefix).resolve(),
        REPO_ROOT,
    ]
    kept: list[Path] = []
    # Sorted fully (not by depth alone): the image's Dockerfile and labels are made from
    # these, and set order varies between processes, which would defeat the build cache.
    for path in sorted(set(paths), key=lambda p: (len(p.parts), str(p))):
        if not any(path.is_relative_to(parent) for parent in kept):
            kept.append(path)
    return [Mount(str(p), str(p), type="bind", read_only=True) for p in kept]


def learner_environment() -> dict[str, str]:
    """The environment a learner container runs with (the venv first on PATH)."""
    return {
        "PATH": f"{Path(sys.prefix).resolve() / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "HOME": LEARNER_HOME,
        "PYTHONUNBUFFERED": "1",
        # The mounts are read-only: do not even try to write bytecode next to the source.
        "PYTHONDONTWRITEBYTECODE": "1",
    }


# -- offline route -----------------------------------------------------------------------
def _debootstrap_binary() -> str:
    found = shutil.which("debootstrap") or shutil.which("debootstrap", path="/usr/sbin:/sbin")
    if found is None:
        raise ImageBuildError(
            "no `debootstrap` on PATH: install it with `apt-get install debootstrap` "
            "(`make install` does it as root), or build from a registry with "
            "`rhizome image build --registry`"
        )
    return found


def _add_learner_user(rootfs: Path) -> None:
    """The non-root user learners run as. Written straight into the files (rather than
    `chroot useradd`) so the result does not depend on the host's tools."""
    etc = rootfs / "etc"
    with open(etc / "passwd", "a") as f:
        f.write(f"{LEARNER_USER}:x:{LEARNER_UID}:{LEARNER_UID}::{LEARNER_HOME}:/usr/sbin/nologin\n")
    with open(etc / "group", "a") as f:
        f.write(f"{LEARNER_USER}:x:{LEARNER_UID}:\n")
    with open(etc / "shadow", "a") as f:
        f.write(f"{LEARNER_USER}:!:19000:0:99999:7:::\n")
    home = rootfs / LEARNER_HOME.lstrip("/")
    home.mkdir(parents=True, exist_ok=True)
    os.chown(home, LEARNER_UID, LEARNER_UID)
    home.chmod(0o755)


def _tarball_name() -> str:
    return f"{SUITE}-minbase-{'-'.join(BASE_PACKAGES)}-uid{LEARNER_UID}.tar"


def _rootfs_tarball(progress: Progress) -> Path:
    """debootstrap a minbase root filesystem, add the learner user, and tar it into the
    cache (written aside then renamed, so a killed build never leaves half a tarball)."""
    debootstrap = _debootstrap_binary()
    if os.geteuid() != 0:
        raise ImageBuildError(
            "debootstrap must run as root (it makes device nodes and chroots): run "
            "`rhizome image build` as root, or build from a registry with --registry"
        )
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / _tarball_name()
    work = Path(tempfile.mkdtemp(prefix="rootfs-", dir=cache))
    log_path = cache / "debootstrap.log"
    try:
        rootfs = work / "rootfs"
        mirror = os.environ.get("RHIZOME_DEBIAN_MIRROR", DEFAULT_MIRROR)
        progress(
            f"debootstrap --variant=minbase {SUITE} from {mirror} (about 30 s; log: {log_path})"
        )
        started = time.monotonic()
        with open(log_path, "wb") as log:
            result = subprocess.run(
                [
                    debootstrap,
                    "--variant=minbase",
                    f"--include={','.join(BASE_PACKAGES)}",
                    SUITE,
                    str(rootfs),
                    mirror,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        if result.returncode != 0:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:]
            raise ImageBuildError(
                f"debootstrap failed with code {result.returncode}"
                f"{': ' + tail[0] if tail else ''} (full log: {log_path})"
            )
        progress(f"debootstrap done in {time.monotonic() - started:.1f} s")
        _add_learner_user(rootfs)
        partial = work / "rootfs.tar"
        subprocess.run(
            ["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(partial), "."],
            check=True,
            capture_output=True,
        )
        partial.rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def ensure_base(client: docker.DockerClient, progress: Progress, rebuild: bool = False) -> str:
    """Make sure the engine has the base image; return how: engine, cache or debootstrap."""
    if not rebuild:
        existing = image_exists(client, BASE_IMAGE)
        if existing:
            progress(f"base image {BASE_IMAGE} already in the engine: skipping debootstrap")
            return "engine"
    tarball = cache_dir() / _tarball_name()
    how = "cache"
    if rebuild or not tarball.exists():
        tarball = _rootfs_tarball(progress)
        how = "debootstrap"
    else:
        progress(f"base root filesystem cached at {tarball}: skipping debootstrap")
    progress(f"importing {BASE_IMAGE}")
    started = time.monotonic()
    repository, tag = BASE_IMAGE.split(":")
    try:
        client.api.import_image(src=str(tarball), repository=repository, tag=tag)
    except APIError as exc:
        raise ImageBuildError(f"the engine refused to import {tarball}: {exc.explanation}") from exc
    if not image_exists(client, BASE_IMAGE):
        raise ImageBuildError(f"importing {tarball} did not produce {BASE_IMAGE}")
    progress(f"imported {BASE_IMAGE} in {time.monotonic() - started:.1f} s")
    return how


def _ancestors(paths: list[Path]) -> list[str]:
    found: set[str] = set()
    for path in paths:
        found.update(str(parent) for parent in path.parents if str(parent) != "/")
    return sorted(found, key=lambda p: (p.count("/"), p))  # deterministic: see learner_mounts


def offline_dockerfile(tag: str) -> str:
    """The thin layer on the debootstrap base. The RUN makes existing ancestors of the
    mount points traversable: Debian's /root is 0700, which would hide a Python install
    under /root/.pyenv from uid 10001 even though the mount itself is readable."""
    mounts = [Path(m["Target"]) for m in learner_mounts()]
    env = learner_environment()
    labels = offline_labels(tag)
    lines = [
        f"FROM {BASE_IMAGE}",
        "RUN for d in "
        + " ".join(_ancestors(mounts) or ["/"])
        + '; do if [ -d "$d" ]; then chmod o+x "$d"; fi; done',
        "ENV " + " ".join(f"{k}={json.dumps(v)}" for k, v in sorted(env.items())),
        f"USER {LEARNER_UID}:{LEARNER_UID}",
        f"WORKDIR {LEARNER_HOME}",
        "LABEL " + " ".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items())),
        'CMD ["python", "-m", "learner.controller"]',
    ]
    return "\n".join(lines) + "\n"


def offline_labels(tag: str) -> dict[str, str]:
    """What the backend needs to know to run the image: the paths it expects mounted."""
    return {
        f"{LABEL_PREFIX}.image": "learner",
        f"{LABEL_PREFIX}.tag": tag,
        f"{LABEL_PREFIX}.version": services.__version__,
        f"{LABEL_PREFIX}.route": "offline",
        f"{LABEL_PREFIX}.entrypoint": "python -m learner.controller",
        f"{LABEL_PREFIX}.mounts": ",".join(m["Target"] for m in learner_mounts()),
        f"{LABEL_PREFIX}.uid": str(LEARNER_UID),
    }


def _build(client: docker.DockerClient, progress: Progress, tag: str, **kwargs: Any) -> str:
    """`docker build` through the SDK, streaming its steps as progress lines."""
    image_id = ""
    try:
        for chunk in client.api.build(tag=tag, rm=True, forcerm=True, decode=True, **kwargs):
            if "error" in chunk:
                raise ImageBuildError(f"docker build of {tag} failed: {chunk['error'].strip()}")
            text = str(chunk.get("stream", "")).strip()
            if text.startswith("Step "):
                progress(f"  {text}")
            aux = chunk.get("aux")
            if isinstance(aux, dict) and "ID" in aux:
                image_id = str(aux["ID"])
    except APIError as exc:
        raise ImageBuildError(f"docker build of {tag} failed: {exc.explanation}") from exc
    return image_id or image_exists(client, tag) or ""


def build_offline(
    client: docker.DockerClient,
    progress: Progress,
    tag: str | None = None,
    rebuild_base: bool = False,
) -> BuildResult:
    tag = tag or learner_tag()
    started = time.monotonic()
    base = ensure_base(client, progress, rebuild=rebuild_base)
    progress(f"building {tag} on {BASE_IMAGE}")
    dockerfile = offline_dockerfile(tag).encode()
    # No bridge on our engine: the RUN step gets no network (it needs none).
    image_id = _build(client, progress, tag, fileobj=io.BytesIO(dockerfile), network_mode="none")
    return BuildResult(image_id, tag, "offline", base, time.monotonic() - started)


# -- registry route ----------------------------------------------------------------------
def build_from_registry(
    client: docker.DockerClient, progress: Progress, tag: str | None = None
) -> BuildResult:
    tag = tag or learner_tag()
    started = time.monotonic()
    progress(f"building {tag} from deploy/docker/Dockerfile.learner (pulls python:3.11-slim)")
    image_id = _build(
        client,
        progress,
        tag,
        path=str(REPO_ROOT),
        dockerfile="deploy/docker/Dockerfile.learner",
        pull=True,
    )
    return BuildResult(image_id, tag, "registry", "registry", time.monotonic() - started)


def build_learner_image(
    offline: bool | None,
    progress: Progress,
    docker_host: str | None = None,
    rebuild_base: bool = False,
) -> BuildResult:
    """The `rhizome image build` entry: `offline=None` picks offline when no registry answers."""
    client = connect(docker_host)
    try:
        if offline is None:
            offline = not registry_reachable()
            if offline:
                progress("no container registry answers: building offline (debootstrap base)")
        if offline:
            return build_offline(client, progress, rebuild_base=rebuild_base)
        return build_from_registry(client, progress)
    except (RequestException, DockerException) as exc:
        if isinstance(exc, APIError):
            raise ImageBuildError(f"the engine at {engine_url(docker_host)}: {exc}") from exc
        raise EngineUnreachable(
            f"lost the Docker engine at {engine_url(docker_host)} while building: {exc}"
        ) from exc
    finally:
        client.close()
