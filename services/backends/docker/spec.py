"""What a learner container is: names, labels, mounts, limits and devices.

Pure functions of the job and the options (no engine): `container_spec` returns the
keyword arguments of the docker SDK's `containers.create`, which the unit tests check
without an engine and the backend hands to the engine as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from docker.types import DeviceRequest, LogConfig, Mount

from contract.containers import LABEL_GENERATION as LABEL_GENERATION
from contract.containers import LABEL_JOB as LABEL_JOB
from contract.containers import LABEL_RANK as LABEL_RANK
from contract.containers import LABEL_RESTART as LABEL_RESTART
from contract.containers import label_filter
from contract.env import Role, labels
from services.backends.api import JobSpec
from services.backends.local.backend import local_stores
from services.images.build import LEARNER_HOME, LEARNER_UID, learner_environment, learner_mounts

LABEL_ROLE = "rhizome.role"
LABEL_MEMORY_MB = "rhizome.memory_mb"
# The engine's stand-in for the host as seen from a bridge network (engine >= 20.10).
HOST_ALIAS = "host.docker.internal"
ENTRYPOINT = "python -m learner.controller"
# PID 1 is docker-init (signals forwarded, orphans reaped). The controller keeps the
# container's stdout/stderr for the user command and logs to controller.log itself
# (`command_output: passthrough` in its spec), so the container's streams are the
# command's output only, which the platform's per-job collector ships.


def container_name(job_id: str, rank: int, generation: int) -> str:
    return f"rz-{job_id}-{rank}-g{generation}"


def network_name(job_id: str) -> str:
    return f"rz-{job_id}"


def job_filter(job_id: str, rank: int | None = None) -> dict[str, Any]:
    """The engine's label filter for a job's objects (and one rank's containers)."""
    return dict(label_filter(job_id, rank))


def handle_of(container_id: str) -> int:
    """The guardian's int handle for a container: its id's first 15 hex digits."""
    return int(container_id[:15], 16)


def id_prefix(handle: int) -> str:
    return f"{handle:015x}"


@dataclass
class ContainerOptions:
    """How this platform runs learner containers (the backend's configuration)."""

    image: str
    uid: int = LEARNER_UID
    gid: int = LEARNER_UID
    pids_limit: int = 4096
    tmp_size: str = "1g"
    # "host", or the name of the job's own network when the engine has a bridge.
    network: str = "host"
    code_mounts: list[Mount] = field(default_factory=learner_mounts)
    base_env: dict[str, str] = field(default_factory=learner_environment)
    init: bool = True
    # The engine's json-file log of each container, capped: a learner printing without
    # end must not fill the engine's disk. The job's log collector follows the stream as
    # it is written, so rotation loses nothing it shipped; only what a collector that is
    # down misses, beyond max_size x max_files, is gone.
    log_max_size: str = "64m"
    log_max_files: int = 2


def gpu_devices(host_ids: str) -> tuple[list[DeviceRequest], str]:
    """The NVIDIA runtime's device request for these host GPU ids ("2,3"), and the
    CUDA_VISIBLE_DEVICES the learner sees inside (the runtime renumbers them 0..n-1)."""
    ids = [i.strip() for i in host_ids.split(",") if i.strip()]
    if not ids:
        return [], ""
    request = DeviceRequest(driver="nvidia", device_ids=ids, capabilities=[["gpu"]])
    return [request], ",".join(str(i) for i in range(len(ids)))


def reachable_url(url: str, network: str) -> str:
    """A platform endpoint as a learner reaches it: as is on the host network; on a
    bridge network, loopback becomes the engine's host alias."""
    if network == "host" or not url:
        return url
    bare = "://" not in url
    parts = urlsplit(url if not bare else f"tcp://{url}")
    if parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        return url
    netloc = f"{HOST_ALIAS}:{parts.port}" if parts.port else HOST_ALIAS
    out = urlunsplit(parts._replace(netloc=netloc))
    return out.removeprefix("tcp://") if bare else out


def data_mounts(job: JobSpec, rank: int) -> list[Mount]:
    """What of the platform's storage one learner may touch, at the same paths: the job's
    code archive (read-only), its result store (read-write), local data stores' training
    data (read-only) and their per-job results containers (read-write)."""
    mounts: list[Mount] = []
    if job.model_zip:
        mounts.append(Mount(job.model_zip, job.model_zip, type="bind", read_only=True))
    if job.result_store:
        mounts.append(Mount(job.result_store, job.result_store, type="bind"))
    for store in local_stores(job, rank):
        source = str(store["connection"]["path"])
        mounts.append(Mount(source, source, type="bind", read_only=True))
        results = store.get("results_path")
        if results:
            parent = str(Path(results).parent)  # the job's folder: every rank shares it
            mounts.append(Mount(parent, parent, type="bind"))
    return mounts


def container_spec(
    job: JobSpec,
    rank: int,
    restart: int,
    spec_path: str,
    options: ContainerOptions,
    image: str | None = None,
    gpu_ids: str = "",
    secrets_file: str | None = None,
    secrets_source: str | None = None,
) -> dict[str, Any]:
    """`containers.create` arguments for learner `rank` of `job`."""
    learner_dir = str(Path(spec_path).parent)
    env = dict(options.base_env)
    env.update(labels(job.job_id, rank, Role.CONTROLLER))
    requests, _ = gpu_devices(gpu_ids)
    mounts = [
        *options.code_mounts,
        Mount(job.job_dir, job.job_dir, type="bind"),
        *data_mounts(job, rank),
    ]
    if secrets_file:
        # At the path the learner is told (`RHIZOME_SECRETS`), from where the backend
        # keeps it on the host (a tmpfs: `DockerBackend.secrets_file`).
        source = secrets_source or secrets_file
        mounts.append(Mount(secrets_file, source, type="bind", read_only=True))
    tmpfs = {
        "/tmp": f"rw,nosuid,nodev,size={options.tmp_size},mode=1777",
        LEARNER_HOME: f"rw,nosuid,nodev,size=256m,uid={options.uid},gid={options.gid},mode=0700",
    }
    kwargs: dict[str, Any] = {
        "image": image or options.image,
        "command": ["python", "-m", "learner.controller", "--spec", spec_path],
        "name": container_name(job.job_id, rank, job.generation),
        "labels": {
            LABEL_JOB: job.job_id,
            LABEL_RANK: str(rank),
            LABEL_GENERATION: str(job.generation),
            LABEL_RESTART: str(restart),
            LABEL_ROLE: Role.CONTROLLER.value,
            LABEL_MEMORY_MB: str(int(job.memory_mb)),
        },
        "user": f"{options.uid}:{options.gid}",
        "environment": env,
        "working_dir": learner_dir,
        "mounts": mounts,
        "read_only": True,
        "tmpfs": tmpfs,
        "init": options.init,
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "pids_limit": options.pids_limit,
        "stop_signal": "SIGTERM",
        "log_config": LogConfig(
            type=LogConfig.types.JSON,
            config={"max-size": options.log_max_size, "max-file": str(options.log_max_files)},
        ),
    }
    if options.network == "host":
        kwargs["network_mode"] = "host"
    else:
        kwargs["network"] = options.network
        kwargs["extra_hosts"] = {HOST_ALIAS: "host-gateway"}
    if job.memory_mb > 0:
        limit = f"{int(job.memory_mb)}m"
        kwargs["mem_limit"] = limit
        kwargs["memswap_limit"] = limit  # no swap: the limit is the limit
    cpus = job.manifest.resources.cpus
    if cpus > 0:
        kwargs["nano_cpus"] = int(cpus * 1e9)
    if requests:
        kwargs["device_requests"] = requests
    return kwargs
