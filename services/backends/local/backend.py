"""The local backend: every learner is a process group on this machine.

Layout of a job directory (`<data_dir>/jobs/<job_id>/`):

    code/                 the job's model zip, extracted by the learners (DOWNLOADING)
    data/<store id>       links to local data stores
    checkpoints/          $RHIZOME_CHECKPOINT_DIR, kept across halt/resume and rollbacks
    results/<rank>/       $RHIZOME_RESULT_DIR, copied to the result store when a learner ends
    secrets/env           data-store credentials (mode 0600)
    learners/<rank>/      spec.json, controller.json, controller.log, stdout.log, stderr.log

Each learner controller runs in a session of its own, labelled in its environment with
the job id, its rank and its role; the user command it starts inherits the labels. That
label is how `rollback` and `stop_learners` find every process of a job, including ones
whose parents died. Memory limits use a memory cgroup when this process may create one
(cgroup v1 or v2, as root or with delegation) and are skipped otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from contract import env as learner_vars
from contract import procs
from contract.env import LearnerConfigError, LearnerEnv, Role
from contract.learner_spec import LearnerSpec
from services.backends.api import Backend, BackendError, JobSpec, register_backend

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")


def manifest_variables(job: JobSpec) -> dict[str, str]:
    """The learner variables the manifest's checkpoint: and pipeline: sections set."""
    ck = job.manifest.checkpoint
    out = {
        learner_vars.CHECKPOINT_POLICY: ck.policy,
        learner_vars.KEEP: str(ck.keep - 1),  # the section counts the newest one too
    }
    if ck.interval_s is not None:
        out[learner_vars.CHECKPOINT_INTERVAL_S] = str(ck.interval_s)
    pipe = job.manifest.pipeline
    if pipe is not None:
        out[learner_vars.PIPELINE_STAGES] = str(pipe.stages)
        out[learner_vars.PIPELINE_PIPELINES] = str(pipe.pipelines)
        out[learner_vars.PIPELINE_REDUNDANCY] = pipe.redundancy
        if pipe.microbatches is not None:
            out[learner_vars.PIPELINE_MICROBATCHES] = str(pipe.microbatches)
    return out


def local_stores(job: JobSpec, rank: int) -> list[dict[str, Any]]:
    """What the controller needs of the data stores that have a local path: where the
    training data is (`data/<id>` links there: the path, or its `training_data` container)
    and where this learner's results are copied too (the `training_results` container,
    per job and rank). Credentials go to secrets/env alone, never into spec.json."""
    out: list[dict[str, Any]] = []
    for ds in job.manifest.data_stores:
        root = ds.connection.get("path")
        if not root:
            continue
        entry: dict[str, Any] = {
            "id": ds.id,
            "type": ds.type,
            "connection": {
                "path": str(Path(root) / ds.training_data) if ds.training_data else root
            },
        }
        if ds.training_results:
            entry["results_path"] = str(Path(root) / ds.training_results / job.job_id / str(rank))
        out.append(entry)
    return out


def learner_env(job: JobSpec, rank: int) -> dict[str, str]:
    """The environment a distributed learner expects: torch.distributed's env:// names and
    the `LearnerEnv` of the contract. The manifest's checkpoint: and pipeline: sections
    come first, then its own `env` (an explicit variable there wins), then the platform's
    estimates, the grace it really gives and the learner's identity. A malformed
    `RHIZOME_*` value fails this deploy step, naming the variable, not the learner."""
    nodes = {str(k): str(v) for k, v in (job.placement.get("learner_nodes") or {}).items()}
    node = nodes.get(str(rank), "local")
    same_node = [r for r in range(job.learners) if nodes.get(str(r), "local") == node]
    local_rank = same_node.index(rank) if rank in same_node else 0
    env = manifest_variables(job)
    env.update(job.manifest.env)
    env.update(job.platform_env)
    env[learner_vars.GRACE_S] = str(job.grace_s)
    try:
        chosen = LearnerEnv.from_environ(env)
    except LearnerConfigError as exc:
        raise BackendError(f"learner {rank}: the manifest's env: {exc}") from exc
    contract_env = dataclasses.replace(
        chosen,
        job_id=job.job_id,
        rank=rank,
        learner_id=str(rank),
        job_dir=job.job_dir,
        checkpoint_dir=job.checkpoint_dir,
        result_dir=str(Path(job.job_dir) / "results" / str(rank)),
        secrets=str(Path(job.job_dir) / "secrets" / "env"),
    )
    env.update(contract_env.to_environ())
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(job.learners),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(len(same_node)),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job.master_port),
        CUDA_VISIBLE_DEVICES=visible_devices(job, rank, local_rank),
        PYTHONUNBUFFERED="1",
    )
    return env


def visible_devices(job: JobSpec, rank: int, local_rank: int) -> str:
    """GPU ids from the placement (`gpu_ids: {rank: [..]}`), else consecutive per node."""
    explicit = (job.placement.get("gpu_ids") or {}).get(str(rank))
    if explicit is not None:
        return ",".join(str(g) for g in explicit)
    per = int(job.gpus_per_learner) if job.gpus_per_learner >= 1 else 0
    if job.gpus_per_learner > 0 and per == 0:
        per = 1  # a fractional GPU still needs a device to share
    return ",".join(str(local_rank * per + i) for i in range(per))


def learner_spec(job: JobSpec, rank: int, restart: int = 0) -> LearnerSpec:
    """What learner `rank`'s controller is told (spec.json); the same on every backend."""
    return LearnerSpec(
        job_id=job.job_id,
        rank=rank,
        world_size=job.learners,
        job_dir=job.job_dir,
        command=job.command,
        etcd_url=job.etcd_url,
        generation=job.generation,
        restart=restart,
        env=learner_env(job, rank),
        model_zip=job.model_zip,
        data_stores=local_stores(job, rank),
        result_store=str(Path(job.result_store) / str(rank)),
        tds_address=job.tds_address,
        tds_token=job.tds_token,
        metric_sources=job.manifest.evaluation_metrics,
        grace_s=job.grace_s,
    )


def prepare_job_dir(job: JobSpec) -> None:
    """The job directory exists with its parts; code from an earlier deploy is gone."""
    root = Path(job.job_dir)
    if job.model_zip and not Path(job.model_zip).is_file():
        raise BackendError(f"the job's code {job.model_zip} is missing from the object store")
    # Code from an earlier deploy is stale; logs, checkpoints and results are not.
    shutil.rmtree(root / "code", ignore_errors=True)
    for sub in ("learners", "checkpoints", "results", "data"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    Path(job.checkpoint_dir).mkdir(parents=True, exist_ok=True)


def write_secrets_file(job: JobSpec, owner: tuple[int, int] | None = None) -> Path:
    """Data-store credentials in `<job_dir>/secrets/env`: mode 0600, or 0400 and owned by
    `owner` (uid, gid) when given (a container's learner user)."""
    secrets = Path(job.job_dir) / "secrets"
    secrets.mkdir(mode=0o700, parents=True, exist_ok=True)
    lines = []
    for store in job.manifest.data_stores:
        for key, value in sorted(store.connection.items()):
            name = f"{store.id}_{key}".upper().replace("-", "_")
            lines.append(f"{name}={value}")
    path = secrets / "env"
    with contextlib.suppress(FileNotFoundError):
        path.chmod(0o600)  # a 0400 file from an earlier deploy
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("\n".join(lines) + ("\n" if lines else ""))
    if owner is not None:
        os.chown(secrets, *owner)
        os.chown(path, *owner)
        path.chmod(0o400)
    return path


def remove_deploy_files(job_dir: str) -> None:
    """What a deploy wrote that a rollback removes: code, secrets, partial extractions."""
    root = Path(job_dir)
    shutil.rmtree(root / "code", ignore_errors=True)
    shutil.rmtree(root / "secrets", ignore_errors=True)
    if root.exists():
        for tmp in root.glob(".code.tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)


def tail_logs(job_dir: str, rank: int, lines: int = 20) -> list[str]:
    """The last lines learner `rank` wrote (stderr, then stdout) in its job directory."""
    learner_dir = Path(job_dir) / "learners" / str(rank)
    out: list[str] = []
    for name in ("stderr.log", "stdout.log"):
        path = learner_dir / name
        with contextlib.suppress(OSError):
            with open(path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 16384))
                text = fh.read().decode(errors="replace").splitlines()
            out.extend(f"[{name.split('.')[0]}] {line}" for line in text[-lines:])
        if len(out) >= lines:
            break
    return out[-lines:]


class LocalBackend(Backend):
    name = "local"

    def __init__(self, python: str = sys.executable, reaper: procs.Reaper | None = None) -> None:
        self.python = python
        # With a reaper (a subreaper process reaps every child itself) exit codes come
        # from it; Popen.poll would race it.
        self.reaper = reaper
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._exited: dict[int, int] = {}
        self._cgroups: dict[str, list[Path]] = defaultdict(list)

    # -- deploy steps --------------------------------------------------------------------
    def prepare_volume(self, job: JobSpec) -> None:
        prepare_job_dir(job)

    def write_secrets(self, job: JobSpec) -> None:
        write_secrets_file(job)

    def start_learner(self, job: JobSpec, rank: int, restart: int = 0) -> int:
        spec = learner_spec(job, rank, restart)
        learner_dir = spec.learner_dir
        spec_path = learner_dir / "spec.json"
        spec.dump(spec_path)
        env = dict(os.environ)
        for key in learner_vars.platform_variables(env):
            env.pop(key)  # the platform's own settings are not the learner's business
        env.update(
            {
                **learner_vars.labels(job.job_id, rank, Role.CONTROLLER),
                "PYTHONUNBUFFERED": "1",
                # `python` in a manifest means the platform's interpreter on this machine.
                "PATH": os.pathsep.join([str(Path(self.python).parent), env.get("PATH", "")]),
            }
        )
        with open(learner_dir / "controller.log", "ab") as logf:
            try:
                proc = subprocess.Popen(
                    [self.python, "-m", "learner.controller", "--spec", str(spec_path)],
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    cwd=learner_dir,
                    start_new_session=True,
                )
            except OSError as exc:
                raise BackendError(f"cannot start learner {rank}: {exc}") from exc
        self._procs[proc.pid] = proc
        if self.reaper is not None:
            self.reaper.watch(proc.pid, self._on_exit)
        if job.memory_mb:
            self._limit_memory(job.job_id, rank, proc.pid, job.memory_mb)
        return proc.pid

    def start_helper(self, job: JobSpec) -> None:
        """Locally each controller ships its own logs (the collector runs inside it), so
        there is no per-job helper process; the step is recorded for the same shape of
        deploy on every backend."""

    def _on_exit(self, pid: int, code: int) -> None:
        self._exited[pid] = code

    def learner_exited(self, handle: int) -> int | None:
        if self.reaper is not None:
            if handle in self._exited:
                self._procs.pop(handle, None)
                return self._exited.pop(handle)
            return None
        proc = self._procs.get(handle)
        if proc is None:
            return None
        code = proc.poll()
        if code is not None:
            self._procs.pop(handle, None)
        return code

    # -- undo ------------------------------------------------------------------------------
    def stop_learners(self, job_id: str, grace_s: float) -> None:
        procs.kill_labelled(job_id, grace_s=grace_s)
        self._reap()

    def rollback(self, job_id: str, job_dir: str) -> None:
        procs.kill_labelled(job_id)
        self._reap()
        remove_deploy_files(job_dir)
        for cgroup in self._cgroups.pop(job_id, []):
            with contextlib.suppress(OSError):
                cgroup.rmdir()

    def running(self, job_id: str) -> list[int]:
        return procs.labelled(job_id)

    def log_tail(self, job_dir: str, rank: int, lines: int = 20) -> list[str]:
        return tail_logs(job_dir, rank, lines)

    # -- helpers -------------------------------------------------------------------------------
    def _reap(self) -> None:
        if self.reaper is not None:
            return
        for pid, proc in list(self._procs.items()):
            if proc.poll() is not None:
                self._procs.pop(pid, None)

    def _limit_memory(self, job_id: str, rank: int, pid: int, memory_mb: float) -> None:
        limit = str(int(memory_mb * 1024 * 1024))
        name = f"rhizome-{job_id}-{rank}-{pid}"
        try:
            base = _memory_cgroup_dir()
            if base is None:
                return
            group = base / name
            group.mkdir(exist_ok=True)
            v2 = (group / "memory.max").exists()
            (group / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(limit)
            (group / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            log.info("memory limit not enforced for %s/%d: %s", job_id, rank, exc)
            return
        self._cgroups[job_id].append(group)


def _memory_cgroup_dir() -> Path | None:
    """This process's memory cgroup directory, if we may create children in it."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                candidate = CGROUP_ROOT / "memory" / path.lstrip("/")
            elif controllers == "" and (CGROUP_ROOT / "cgroup.controllers").exists():
                candidate = CGROUP_ROOT / path.lstrip("/")
                if "memory" not in (candidate / "cgroup.subtree_control").read_text():
                    continue
            else:
                continue
            if candidate.is_dir() and os.access(candidate, os.W_OK):
                return candidate
    return None


register_backend("local", LocalBackend)

__all__ = [
    "LocalBackend",
    "learner_env",
    "learner_spec",
    "local_stores",
    "prepare_job_dir",
    "remove_deploy_files",
    "tail_logs",
    "visible_devices",
    "write_secrets_file",
]
