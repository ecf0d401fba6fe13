"""The local backend: every learner is a process group on this machine.

Layout of a job directory (`<data_dir>/jobs/<job_id>/`):

    code/                 the job's model zip, extracted by the learners (DOWNLOADING)
    data/<store id>       links to local data stores
    model.zip             a copy of the code archive the learner may read (per-job uid only)
    checkpoints/          $RHIZOME_CHECKPOINT_DIR, kept across halt/resume and rollbacks
    results/<rank>/       $RHIZOME_RESULT_DIR, copied to the result store when a learner ends
    secrets/env           data-store credentials (mode 0400, the job's user only)
    learners/<rank>/      spec.json, controller.json, controller.log, stdout.log, stderr.log

The job directory is mode 0700 and belongs to the user the job's learners run as: a uid
of the job's own when the daemon is root, else the daemon's user (isolation.py, which
also says how the platform writes into it safely afterwards).

Each learner controller runs in a session of its own, labelled in its environment with
the job id, its rank and its role; the user command it starts inherits the labels. That
label is how `rollback` and `stop_learners` find every process of a job, including ones
whose parents died. Memory limits use a memory cgroup when this process may create one
(cgroup v1 or v2, as root or with delegation) and are skipped otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import contract
from contract import env as learner_vars
from contract import procs
from contract.credentials import TDS_TLS_FILE
from contract.env import LearnerConfigError, LearnerEnv, Role
from contract.learner_spec import LearnerSpec
from services.backends.api import (
    Backend,
    BackendError,
    JobSpec,
    cannot_block,
    register_backend,
)
from services.backends.local import isolation
from services.backends.local.isolation import IsolationConfig, IsolationError, LearnerUser

log = logging.getLogger(__name__)

LEARNER_PYTHON_VARIABLE = "RHIZOME_LEARNER_PYTHON"

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
        out[learner_vars.PIPELINE_METRICS_EVERY] = str(pipe.metrics_every)
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
        # the platform's etcd, not a manifest's choice: the workers' rendezvous lives there
        elastic_etcd=job.etcd_url if job.manifest.elastic is not None else None,
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
        tds_tls=job.tds_tls,
        etcd_credentials=job.etcd_credentials,
        metric_sources=job.manifest.metric_sources,
        grace_s=job.grace_s,
        lease_ttl_s=job.learner_lease_ttl_s,
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


def secrets_text(job: JobSpec) -> str:
    """The data stores' connection settings as `STORE_KEY=value` lines."""
    lines = []
    for store in job.manifest.data_stores:
        for key, value in sorted(store.connection.items()):
            name = f"{store.id}_{key}".upper().replace("-", "_")
            lines.append(f"{name}={value}")
    return "\n".join(lines) + ("\n" if lines else "")


def write_secrets_file(job: JobSpec, owner: tuple[int, int] | None = None) -> Path:
    """Data-store credentials in `<job_dir>/secrets/env`: mode 0600, or 0400 and owned by
    `owner` (uid, gid) when given (a container's learner user)."""
    secrets = Path(job.job_dir) / "secrets"
    secrets.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = secrets / "env"
    with contextlib.suppress(FileNotFoundError):
        path.chmod(0o600)  # a 0400 file from an earlier deploy
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets_text(job))
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
    out: list[str] = []
    for name in ("stderr.log", "stdout.log"):
        # The learner owns these files: a link it put there is refused, never followed
        # (the daemon may be root, and these lines go into the job record).
        try:
            data = isolation.read_tail(Path(job_dir), ["learners", str(rank)], name, 16384)
        except isolation.UnsafePath as exc:
            out.append(f"[{name.split('.')[0]}] (not read: {exc})")
            continue
        except OSError:
            continue
        text = data.decode(errors="replace").splitlines()
        out.extend(f"[{name.split('.')[0]}] {line}" for line in text[-lines:])
        if len(out) >= lines:
            break
    return out[-lines:]


class PrivateInterpreter(BackendError):
    """Learner uids cannot run any interpreter with the platform's packages: the deploy
    fails (under `auto` too) rather than run the learners as root."""


class LocalBackend(Backend):
    name = "local"
    renews_tls = True

    def __init__(
        self,
        python: str | None = None,
        reaper: procs.Reaper | None = None,
        isolation_config: IsolationConfig | None = None,
    ) -> None:
        # The interpreter learners run: the daemon's, unless the operator names one that
        # learner uids can read (the daemon's may live in root's private home).
        self.python = python or os.environ.get(LEARNER_PYTHON_VARIABLE) or sys.executable
        # With a reaper (a subreaper process reaps every child itself) exit codes come
        # from it; Popen.poll would race it.
        self.reaper = reaper
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._exited: dict[int, int] = {}
        self._cgroups: dict[str, list[Path]] = defaultdict(list)
        self._users: dict[str, LearnerUser] = {}
        # A bad setting fails the deploy step with its message (recorded on the job), not
        # the guardian's start.
        self._isolation: IsolationConfig | IsolationError
        try:
            self._isolation = isolation_config or IsolationConfig.from_env()
        except IsolationError as exc:
            self._isolation = exc

    # -- who the learners are ---------------------------------------------------------------
    def learner_user(self, job: JobSpec) -> LearnerUser:
        """The user job `job`'s learners run as (claimed once, then reused)."""
        user = self._users.get(job.job_id)
        if user is None:
            if isinstance(self._isolation, IsolationError):
                raise BackendError(str(self._isolation))
            try:
                user = isolation.learner_user(self._isolation, Path(job.job_dir).parent, job.job_id)
            except (IsolationError, OSError) as exc:
                raise BackendError(f"no user for the job's learners: {exc}") from exc
            if user.switches:
                user = self._reachable_or_fallback(job, user)
            self._users[job.job_id] = user
        return user

    def _reachable_or_fallback(self, job: JobSpec, user: LearnerUser) -> LearnerUser:
        """`user` if it can reach what a learner needs; under `auto` otherwise the
        daemon's own user, with a warning saying what to change."""
        try:
            self._lock_down(job)  # the data directory becomes traversable, no more
            self._check_reachable(job, user, interpreter=False)
            self._use_reachable_python(job, user)
            self._check_reachable(job, user)
        except OSError as exc:
            raise BackendError(
                f"cannot prepare the data directory for uid {user.uid}: {exc}"
            ) from exc
        except BackendError as exc:
            assert not isinstance(self._isolation, IsolationError)
            if self._isolation.strict or isinstance(exc, PrivateInterpreter):
                raise
            log.warning(
                "job %s: learners run as the daemon's user, not isolated: %s", job.job_id, exc
            )
            return LearnerUser(os.getuid(), os.getgid())
        return user

    def _use_reachable_python(self, job: JobSpec, user: LearnerUser) -> None:
        """The daemon's own interpreter, when `user` cannot run it (a pyenv Python under
        root's 0700 home), is swapped for the system's Python of the same version with
        the daemon's packages (isolation.reachable_python), so that learners run isolated
        instead of as root. An interpreter the operator named is left as it is."""
        if self.python != sys.executable:
            return
        interpreter = Path(self.python).resolve()
        stdlib = Path(os.__file__).resolve().parent
        if (
            isolation.unreachable(interpreter.parent, user) is None
            and isolation.unreachable(stdlib, user) is None
        ):
            return
        shim = isolation.reachable_python(Path(job.job_dir).parent.parent, user)
        if shim is None:
            version = f"python{sys.version_info.major}.{sys.version_info.minor}"
            raise PrivateInterpreter(
                f"the job's learners run as uid {user.uid}, which cannot run the daemon's "
                f"Python ({interpreter}) and there is no {version} in "
                f"{' or '.join(isolation.SYSTEM_PYTHON_DIRS)} to run them with: install "
                f"{version} where others can read it (e.g. apt-get install {version}), or "
                f"name one with {LEARNER_PYTHON_VARIABLE}, or set "
                f"{isolation.UIDS_VARIABLE}=off to run learners as the daemon's user "
                "(no isolation between jobs)"
            )
        log.info(
            "learner uids cannot reach %s; learners run %s (the system's Python of the "
            "same version with the daemon's packages)",
            interpreter,
            shim,
        )
        self.python = str(shim)

    def _seen_by_learner(self, job: JobSpec, user: LearnerUser) -> JobSpec:
        """The job as its learners see it: under another uid the code archive is the
        job directory's private copy (the object store is the platform's alone)."""
        if user.switches and job.model_zip:
            return dataclasses.replace(job, model_zip=str(Path(job.job_dir) / "model.zip"))
        return job

    def _check_reachable(self, job: JobSpec, user: LearnerUser, interpreter: bool = True) -> None:
        """A learner under another uid must reach its job directory, the interpreter and
        the platform's code; say which directory stops it, and how to fix that."""
        code_root = Path(contract.__file__).resolve().parent.parent  # learner/ beside it
        python = Path(self.python).resolve()
        needed = [
            ("the jobs directory", Path(job.job_dir).parent),
            ("the platform's code", code_root),
        ]
        if interpreter:
            needed.append(("the Python interpreter", python.parent))
        if interpreter and python == Path(sys.executable).resolve():
            needed.append(("the Python standard library", Path(os.__file__).resolve().parent))
        for what, path in needed:
            blocked = isolation.unreachable(path, user)
            if blocked is not None:
                # Never fall back to root over the interpreter (docs/security.md).
                error = PrivateInterpreter if "Python" in what else BackendError
                raise error(
                    f"the job's learners run as uid {user.uid}, which cannot enter {blocked} "
                    f"on the way to {what} ({path}): give it o+x (chmod o+x {blocked}), or "
                    "choose a data directory and install location others may traverse (e.g. "
                    f"--data-dir /var/lib/rhizome) or an interpreter they can read "
                    f"({LEARNER_PYTHON_VARIABLE}), or set {isolation.UIDS_VARIABLE}=off to "
                    "run learners as the daemon's user (no isolation between jobs)"
                )
        if not isolation.readable(code_root / "learner", user):
            raise BackendError(
                f"uid {user.uid} cannot read {code_root / 'learner'}: make the platform's "
                "code readable by others (chmod -R o+rX), or set "
                f"{isolation.UIDS_VARIABLE}=off"
            )

    def _check_data_stores(self, job: JobSpec, user: LearnerUser) -> None:
        """The manifest's local data stores are the user's paths, not the platform's: it
        grants nothing there. Say now, not after training, when the job's uid could not
        read the data or write the results."""
        for store in local_stores(job, 0):
            data = Path(store["connection"]["path"]).expanduser()
            blocked = isolation.unreachable(data, user)
            if blocked is not None or not isolation.readable(data, user):
                raise BackendError(
                    f"data store {store['id']!r}: the job's learners run as uid {user.uid}, "
                    f"which cannot read {data} (stopped at {blocked or data}); make it "
                    "readable by others (chmod -R o+rX)"
                )
            if "results_path" in store:
                results = Path(store["results_path"]).parent.parent  # <container>/<job>/<rank>
                if not isolation.writable(results, user):
                    raise BackendError(
                        f"data store {store['id']!r}: the job's learners run as uid "
                        f"{user.uid}, which cannot write its results container {results}; "
                        f"make it writable by others with the sticky bit (chmod 1777 {results})"
                    )

    def _lock_down(self, job: JobSpec) -> None:
        """Under per-job uids, other uids may only traverse the data directory: the
        object store, the servers' data and the daemon's files stay the daemon's."""
        jobs_dir = Path(job.job_dir).parent
        data_dir = jobs_dir.parent
        jobs_dir.mkdir(parents=True, exist_ok=True)
        isolation.set_mode(data_dir, 0o711)
        isolation.set_mode(jobs_dir, 0o711)
        # Open to others: the jobs (each closed to its uid), the object store (its
        # archives closed, its results the jobs'), and the shim interpreter that learner
        # uids run where the daemon's Python is private (isolation.reachable_python).
        # Closing the shim made every later deploy by the same backend fail.
        open_to_others = (jobs_dir.name, "objects", isolation.SHIM_DIR)
        with contextlib.suppress(OSError):
            for entry in os.scandir(data_dir):
                if entry.name not in open_to_others:
                    isolation.restrict(Path(entry.path), 0o700)
        results = Path(job.result_store).parent
        objects = results.parent
        results.mkdir(parents=True, exist_ok=True)
        isolation.set_mode(objects, 0o711)
        isolation.set_mode(results, 0o711)
        if job.model_zip:
            isolation.set_mode(Path(job.model_zip).parent, 0o700)

    # -- deploy steps --------------------------------------------------------------------
    def prepare_volume(self, job: JobSpec) -> None:
        user = self.learner_user(job)
        if not user.switches:
            prepare_job_dir(job)
            Path(job.job_dir).chmod(0o700)
            return
        root = Path(job.job_dir)
        if job.model_zip and not Path(job.model_zip).is_file():
            raise BackendError(f"the job's code {job.model_zip} is missing from the object store")
        self._check_data_stores(job, user)
        try:
            root.mkdir(parents=True, exist_ok=True)
            isolation.own_directory(root, user.owner)
            # Code from an earlier deploy is stale; logs, checkpoints, results are not.
            # rmtree under a descriptor never follows a link a learner left.
            with isolation.directory(root) as fd, contextlib.suppress(FileNotFoundError):
                shutil.rmtree("code", dir_fd=fd)
            for sub in ("learners", "checkpoints", "results", "data"):
                with isolation.directory(root, [sub], user.owner):
                    pass
            if Path(job.checkpoint_dir).parent != root:
                Path(job.checkpoint_dir).mkdir(parents=True, exist_ok=True)
                os.chown(job.checkpoint_dir, *user.owner)
            result_store = Path(job.result_store)
            with isolation.directory(result_store.parent, [result_store.name], user.owner):
                pass
            isolation.own_directory(result_store, user.owner)
            if job.model_zip:
                isolation.write_file(
                    root, [], "model.zip", Path(job.model_zip).read_bytes(), 0o400, user.owner
                )
        except OSError as exc:  # UnsafePath included
            raise BackendError(f"cannot prepare {root} for uid {user.uid}: {exc}") from exc

    def write_secrets(self, job: JobSpec) -> None:
        user = self.learner_user(job)
        try:
            isolation.write_file(
                Path(job.job_dir),
                ["secrets"],
                "env",
                secrets_text(job).encode(),
                0o400,
                user.owner if user.switches else None,
            )
        except OSError as exc:
            raise BackendError(f"cannot write the job's secrets: {exc}") from exc

    def start_learner(self, job: JobSpec, rank: int, restart: int = 0) -> int:
        user = self.learner_user(job)
        spec = learner_spec(self._seen_by_learner(job, user), rank, restart)
        root = Path(job.job_dir)
        parts = ["learners", str(rank)]
        owner = user.owner if user.switches else None
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
        as_user: dict[str, Any] = {}
        if user.switches:
            # Not root's home: caches and dotfiles of the job stay in its own directory.
            env.update(HOME=str(root), USER=str(user.uid), LOGNAME=str(user.uid))
            as_user = {"user": user.uid, "group": user.gid, "extra_groups": [], "umask": 0o077}
        try:
            isolation.write_file(root, parts, "spec.json", spec.to_json().encode(), 0o600, owner)
            if spec.tds_tls:  # the newest certificate, over one an earlier guardian renewed
                tls = json.dumps(spec.tds_tls).encode()
                isolation.write_file(root, parts, TDS_TLS_FILE, tls, 0o600, owner)
            log_fd = isolation.open_append(root, parts, "controller.log", owner)
        except OSError as exc:
            raise BackendError(f"cannot write learner {rank}'s files: {exc}") from exc
        with os.fdopen(log_fd, "ab") as logf:
            try:
                proc = subprocess.Popen(
                    [
                        self.python,
                        "-m",
                        "learner.controller",
                        "--spec",
                        str(spec.learner_dir / "spec.json"),
                    ],
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    cwd=spec.learner_dir,
                    start_new_session=True,
                    **as_user,
                )
            except OSError as exc:
                raise BackendError(f"cannot start learner {rank}: {exc}") from exc
        self._procs[proc.pid] = proc
        if self.reaper is not None:
            self.reaper.watch(proc.pid, self._on_exit)
        if job.memory_mb:
            self._limit_memory(job.job_id, rank, proc.pid, job.memory_mb)
        return proc.pid

    def renew_tls(self, job: JobSpec, tls: dict[str, str]) -> None:
        user = self.learner_user(job)
        for rank in range(job.learners):
            try:  # in a directory the learner owns: never through a link it planted
                isolation.write_file(
                    Path(job.job_dir),
                    ["learners", str(rank)],
                    TDS_TLS_FILE,
                    json.dumps(tls).encode(),
                    0o600,
                    user.owner if user.switches else None,
                )
            except (OSError, isolation.UnsafePath) as exc:
                # UnsafePath: a link the learner planted in its own directory (refused,
                # never followed): the guardian's error, naming the learner, as on docker.
                raise BackendError(
                    f"job {job.job_id}: cannot renew learner {rank}'s TDS certificate: {exc}"
                ) from exc

    @cannot_block
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
        self._kill_job_user(job_id)
        self._reap()

    def stop_learner(self, job_id: str, rank: int, grace_s: float) -> None:
        procs.kill_labelled(job_id, rank, grace_s=grace_s)
        self._reap()

    def rollback(self, job_id: str, job_dir: str) -> None:
        procs.kill_labelled(job_id)
        uid = isolation.claimed_uid(Path(job_dir).parent, job_id)
        if uid is not None:
            kill_uid(uid)
        self._reap()
        remove_deploy_files(job_dir)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(Path(job_dir) / "model.zip")
        for cgroup in self._cgroups.pop(job_id, []):
            with contextlib.suppress(OSError):
                cgroup.rmdir()

    def release(self, job_id: str, job_dir: str, result_store: str) -> None:
        """Give the job's uid back once it ended for good (isolation.release_uid): its
        processes killed, its files handed to the daemon, then the claim removed."""
        trees = [Path(job_dir), Path(result_store)] if result_store else [Path(job_dir)]
        try:
            uid = isolation.release_uid(Path(job_dir).parent, job_id, trees, kill_uid)
        except OSError as exc:
            log.warning("job %s: its learner uid stays claimed, release failed: %s", job_id, exc)
            return
        self._users.pop(job_id, None)
        if uid is not None:
            log.info("job %s: released learner uid %d", job_id, uid)

    def release_ended(
        self, jobs_dir: Path, objects_dir: Path, ended: Callable[[str], bool]
    ) -> None:
        try:
            released = isolation.release_stale_claims(
                jobs_dir,
                ended,
                lambda job_id: [jobs_dir / job_id, objects_dir / "results" / job_id],
                kill_uid,
            )
        except OSError as exc:
            log.warning("stale learner uid claims in %s not released: %s", jobs_dir, exc)
            return
        if released:
            log.info("released the learner uids of ended jobs: %s", released)

    def running(self, job_id: str) -> list[int]:
        return procs.labelled(job_id)

    def log_tail(self, job_dir: str, rank: int, lines: int = 20) -> list[str]:
        return tail_logs(job_dir, rank, lines)

    # -- helpers -------------------------------------------------------------------------------
    def _kill_job_user(self, job_id: str) -> None:
        """A process of a job's own uid that dropped its labels (a daemonized child with a
        cleared environment) still belongs to the job: it goes too."""
        user = self._users.get(job_id)
        if user is not None and user.switches:
            kill_uid(user.uid)

    def _reap(self) -> None:
        if self.reaper is not None:
            return
        for pid, proc in list(self._procs.items()):
            if proc.poll() is not None:
                self._procs.pop(pid, None)

    def out_of_memory(self, job_id: str, rank: int) -> bool:
        """Whether the kernel killed a process of the rank's newest memory cgroup (its
        `oom_kill` count); False where no cgroup limits the learner."""
        mine = [
            g
            for g in self._cgroups.get(job_id, [])
            if g.name.startswith(f"rhizome-{job_id}-{rank}-")
        ]
        if not mine:
            return False
        for events in ("memory.events", "memory.oom_control"):  # cgroup v2, v1
            with contextlib.suppress(OSError, ValueError):
                for line in (mine[-1] / events).read_text().splitlines():
                    key, _, count = line.partition(" ")
                    if key == "oom_kill":
                        return int(count) > 0
        return False

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


def kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` (a job's own uid: nothing else runs as it)."""
    if uid == 0 or uid == os.geteuid():
        return  # never the daemon's own processes
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if entry.stat().st_uid == uid:
                os.kill(int(entry.name), signal.SIGKILL)


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
    "kill_uid",
    "learner_env",
    "learner_spec",
    "local_stores",
    "prepare_job_dir",
    "remove_deploy_files",
    "secrets_text",
    "tail_logs",
    "visible_devices",
    "write_secrets_file",
]
