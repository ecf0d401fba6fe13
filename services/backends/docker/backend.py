"""The docker backend: every learner is a container on a Docker engine.

Each learner controller runs in a container of its own (`rz-<job>-<rank>-g<generation>`,
labelled `rhizome.job`, `rhizome.rank`, `rhizome.generation`) from the learner image
(`rhizome-learner:<version>`, or the manifest's `framework.image`): uid 10001, a
read-only root filesystem with tmpfs /tmp and home, the Python install, virtualenv and
source bind-mounted read-only (`services.images.build.learner_mounts()`), and of the
platform's storage only what the job owns: its directory (read-write), its code archive
(read-only), its result store and its data stores. The manifest's CPUs and memory become
`nano_cpus` and `mem_limit` (no swap), GPUs an NVIDIA device request; `pids_limit` caps
processes. Learners use the host network when the engine has no bridge, else a network
of the job's own.

The controller inside is the same as the local backend's (same `LearnerSpec`, same
`LearnerEnv`, same log files in the job directory). Exits and OOM kills come from the
engine's event stream (watch.py); `rollback` removes every container, volume and network
labelled with the job, whatever state the deploy reached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, ContainerError, DockerException, ImageNotFound, NotFound
from requests.exceptions import RequestException

from contract import procs
from contract.containers import COLLECTOR_LOCK_FILE as LOCK_FILE
from contract.containers import COLLECTOR_TLS_ENV
from contract.containers import COLLECTOR_TOKEN_ENV as TDS_TOKEN_ENV
from contract.credentials import TDS_TLS_FILE
from contract.env import ELASTIC_ETCD
from contract.env import PREFIX as _PLATFORM_PREFIX
from contract.learner_spec import CommandOutput, StorageAccess
from services.backends.api import Backend, BackendError, JobSpec, register_backend
from services.backends.docker.spec import (
    ENTRYPOINT,
    LABEL_JOB,
    ContainerOptions,
    container_name,
    container_spec,
    gpu_devices,
    handle_of,
    id_prefix,
    job_filter,
    network_name,
    reachable_url,
)
from services.backends.docker.watch import ContainerState, JobWatch
from services.backends.local import isolation
from services.backends.local.backend import (
    learner_spec,
    prepare_job_dir,
    remove_deploy_files,
    secrets_text,
    tail_logs,
)
from services.images.build import LABEL_PREFIX, LEARNER_UID, engine_url, learner_tag
from services.objectstore.api import (
    DEFAULT_GRANT_TTL_S,
    ObjectStore,
    ObjectStoreError,
    model_key,
    open_object_store,
)

log = logging.getLogger(__name__)

_PROBE = (
    "import importlib.util, sys; "
    "sys.exit(0 if importlib.util.find_spec('learner.controller') else 3)"
)
_ENGINE_ERRORS = (DockerException, RequestException, OSError)
# How long the job's log collector may take to ship what is left when it is stopped.
_HELPER_DRAIN_S = 30.0
# A collector started this recently is not started again (it may not hold its lock yet).
_HELPER_RESTART_S = 5.0


@dataclasses.dataclass(frozen=True)
class _Helper:
    """A job's log collector this process started, and how (to drain once without it)."""

    ref: procs.ProcRef
    argv: list[str]
    env: dict[str, str] = dataclasses.field(repr=False)  # carries the job's TDS token


class DockerBackend(Backend):
    name = "docker"
    renews_tls = True

    def __init__(
        self,
        docker_host: str | None = None,
        image: str | None = None,
        network: str | None = None,
        reaper: procs.Reaper | None = None,  # reaps the log collectors we start
        **_: Any,  # options of other backends
    ) -> None:
        self.reaper = reaper
        self._helper_started: dict[str, float] = {}
        self._helpers: dict[str, _Helper] = {}  # the collectors this process started
        self.url = engine_url(docker_host)
        root = os.geteuid() == 0
        # As root the learners run as the image's uid 10001 and get their files chowned;
        # otherwise as the daemon's own uid (still not root), which owns the job files.
        uid, gid = (LEARNER_UID, LEARNER_UID) if root else (os.getuid(), os.getgid())
        self.chown = root
        self.options = ContainerOptions(
            image=image or os.environ.get("RHIZOME_DOCKER_IMAGE") or learner_tag(),
            uid=uid,
            gid=gid,
            pids_limit=int(os.environ.get("RHIZOME_DOCKER_PIDS_LIMIT", "4096")),
        )
        # "auto": the job's own network when the engine has a bridge, else the host's.
        self.network_choice = network or os.environ.get("RHIZOME_DOCKER_NETWORK", "auto")
        self._client: docker.DockerClient | None = None
        self._lock = threading.Lock()
        self._watches: dict[str, JobWatch] = {}
        self._checked_images: set[str] = set()
        self._bridge: bool | None = None
        # The platform's object store (the daemon exports --object-store); None when
        # nobody configured one: the job's files are then bind-mounted as they are.
        self._store_url = os.environ.get("RHIZOME_OBJECT_STORE", "")
        self._store_endpoint = os.environ.get("RHIZOME_OBJECT_STORE_ENDPOINT", "")
        self.grant_ttl_s = float(
            os.environ.get("RHIZOME_STORAGE_GRANT_TTL_S") or DEFAULT_GRANT_TTL_S
        )
        self._store: ObjectStore | None = None

    # -- the engine ----------------------------------------------------------------------
    def connect(self) -> docker.DockerClient:
        return docker.DockerClient(base_url=self.url, timeout=120)

    def client(self) -> docker.DockerClient:
        with self._lock:
            if self._client is None:
                self._client = self.connect()
            return self._client

    @contextlib.contextmanager
    def engine(self, what: str) -> Iterator[docker.DockerClient]:
        """The client, with the engine's failures as BackendErrors that say what failed."""
        try:
            yield self.client()
        except BackendError:
            raise
        except APIError as exc:
            raise BackendError(f"{what}: the Docker engine refused: {exc.explanation}") from exc
        except _ENGINE_ERRORS as exc:
            raise BackendError(
                f"{what}: the Docker engine at {self.url} does not answer ({exc}); start it "
                "(`rhizome up --embedded --backend docker` runs one) or set DOCKER_HOST"
            ) from exc

    def watch(self, job_id: str) -> JobWatch:
        with self._lock:
            watch = self._watches.get(job_id)
            if watch is None:
                watch = self._watches[job_id] = JobWatch(self.connect, job_id).start()
            return watch

    def uses_bridge(self, client: docker.DockerClient) -> bool:
        if self.network_choice in ("host", "bridge"):
            return self.network_choice == "bridge"
        if self._bridge is None:
            self._bridge = bool(client.networks.list(names=["bridge"]))
        return self._bridge

    def object_store(self) -> ObjectStore | None:
        if not self._store_url:
            return None
        with self._lock:
            if self._store is None:
                try:
                    self._store = open_object_store(
                        self._store_url, default_dir=Path(), endpoint_url=self._store_endpoint
                    )
                except (ObjectStoreError, ValueError) as exc:
                    raise BackendError(f"the object store {self._store_url}: {exc}") from exc
            return self._store

    def remote_store(self) -> ObjectStore | None:
        """The object store when learners reach it over the network (S3), else None."""
        store = self.object_store()
        return store if store is not None and store.remote else None

    # -- deploy steps --------------------------------------------------------------------
    def image_for(self, job: JobSpec) -> str:
        return job.manifest.framework.image or self.options.image

    def check_image(self, client: docker.DockerClient, image: str, job_id: str) -> None:
        """The image exists and runs the learner entry point, or a clear BackendError."""
        try:
            found = client.images.get(image)
        except ImageNotFound:
            raise BackendError(
                f"the learner image {image!r} does not exist in the Docker engine at "
                f"{self.url}: build it with `rhizome image build`"
                + (" or fix the manifest's framework.image" if image != self.options.image else "")
            ) from None
        if found.id in self._checked_images:
            return
        if (found.labels or {}).get(f"{LABEL_PREFIX}.entrypoint") != ENTRYPOINT:
            # Not one of ours: try the entry point once in it, with the learner's mounts.
            problem = ""
            try:
                client.containers.run(
                    image,
                    ["python", "-c", _PROBE],
                    remove=True,
                    user=f"{self.options.uid}:{self.options.gid}",
                    mounts=self.options.code_mounts,
                    environment=self.options.base_env,
                    network_mode="none",
                    read_only=True,
                    labels={LABEL_JOB: job_id},
                )
            except ContainerError as exc:
                err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
                last = (err.strip().splitlines() or [f"exit code {exc.exit_status}"])[-1]
                problem = last
            except APIError as exc:
                problem = str(exc.explanation)
            if problem:
                raise BackendError(
                    f"the image {image!r} lacks the learner entry point: "
                    f"`{ENTRYPOINT}` cannot run in it ({problem})"
                )
        self._checked_images.add(found.id)

    def prepare_volume(self, job: JobSpec) -> None:
        job_dir = Path(job.job_dir).resolve()
        for mount in self.options.code_mounts:
            if job_dir.is_relative_to(mount["Source"]):
                raise BackendError(
                    f"the job directory {job_dir} lies inside {mount['Source']}, which learner "
                    "containers mount read-only: every job's files would be visible to every "
                    "learner; use a data directory outside it"
                )
        with self.engine(f"job {job.job_id}: checking the image") as client:
            self.check_image(client, self.image_for(job), job.job_id)
            self.finish_pending_rollbacks(client, Path(job.job_dir).parent)
        store = self.remote_store()
        if store is not None:
            # The learners fetch the code and keep results in the store themselves.
            key = model_key(job.job_id)
            try:
                missing = bool(job.model_zip) and not store.exists(key)
            except ObjectStoreError as exc:
                raise BackendError(f"job {job.job_id}: {exc}") from exc
            if missing:
                raise BackendError(f"the job's code {key} is missing from {store.url}")
            prepare_job_dir(dataclasses.replace(job, model_zip=""))
            if self.chown:
                _chown_tree(Path(job.job_dir), self.options.uid, self.options.gid)
            return
        prepare_job_dir(job)
        if job.result_store:
            Path(job.result_store).mkdir(parents=True, exist_ok=True)
        if self.chown:
            for path in (job.job_dir, job.result_store):
                if path:
                    _chown_tree(Path(path), self.options.uid, self.options.gid)

    def secrets_file(self, job_dir: str) -> Path:
        """Where the job's data-store credentials are on the host: a tmpfs (`/dev/shm`, or
        `RHIZOME_DOCKER_SECRETS_DIR`), so they never reach a disk; per data directory (a
        hash of its jobs directory), then per job. The container sees the file read-only
        at `<job_dir>/secrets/env`, where `RHIZOME_SECRETS` says it is."""
        jobs = str(Path(job_dir).parent.resolve())
        tag = hashlib.sha256(jobs.encode()).hexdigest()[:12]
        base = Path(os.environ.get("RHIZOME_DOCKER_SECRETS_DIR") or "/dev/shm")
        return base / f"rhizome-secrets-{tag}" / Path(job_dir).name / "env"

    def write_secrets(self, job: JobSpec) -> None:
        path = self.secrets_file(job.job_dir)
        try:
            path.parent.parent.mkdir(mode=0o700, exist_ok=True)
            path.parent.mkdir(mode=0o700, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                path.chmod(0o600)  # a 0400 file of an earlier deploy
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets_text(job))
            if self.chown:
                os.chown(path, self.options.uid, self.options.gid)
            path.chmod(0o400)
        except OSError as exc:
            raise BackendError(
                f"job {job.job_id}: cannot write its secrets in {path}: {exc}"
            ) from exc

    def start_learner(self, job: JobSpec, rank: int, restart: int = 0) -> int:
        what = f"job {job.job_id}: starting learner {rank}"
        with self.engine(what) as client:
            network = "host"
            if self.uses_bridge(client):
                network = self._ensure_network(client, job.job_id)
            store = self.remote_store()
            access: StorageAccess | None = None
            if store is not None:
                # No host path of the store reaches the container: the code archive and
                # the results go through the store, with this job's credentials only.
                try:
                    access = store.grant(
                        job.job_id, with_model=bool(job.model_zip), ttl_s=self.grant_ttl_s
                    )
                except ObjectStoreError as exc:
                    raise BackendError(f"{what}: {exc}") from exc
                job = dataclasses.replace(job, model_zip="", result_store="")
            spec = learner_spec(job, rank, restart)
            # The command writes to the container's streams; the job's helper ships them.
            spec.command_output = CommandOutput.PASSTHROUGH.value
            if access is not None:
                spec.storage = access.to_dict()
                spec.result_store = ""
            host_gpus = spec.env.get("CUDA_VISIBLE_DEVICES", "")
            _, inside = gpu_devices(host_gpus)
            spec.env["CUDA_VISIBLE_DEVICES"] = inside
            if network != "host":
                spec.etcd_url = reachable_url(spec.etcd_url, network)
                if ELASTIC_ETCD in spec.env:  # an elastic job's rendezvous
                    spec.env[ELASTIC_ETCD] = spec.etcd_url
                spec.tds_address = reachable_url(spec.tds_address, network)
                spec.env["MASTER_ADDR"] = container_name(job.job_id, 0, job.generation)
            spec_path = spec.learner_dir / "spec.json"
            spec.dump(spec_path)
            if self.chown:
                _chown_tree(spec.learner_dir, self.options.uid, self.options.gid)
            secrets = self.secrets_file(job.job_dir)
            options = self.options
            if options.network != network:
                options = dataclasses.replace(options, network=network)
            kwargs = container_spec(
                job,
                rank,
                restart,
                str(spec_path),
                options,
                image=self.image_for(job),
                gpu_ids=host_gpus if job.gpus_per_learner > 0 else "",
                secrets_file=str(Path(job.job_dir) / "secrets" / "env")
                if secrets.exists()
                else None,
                secrets_source=str(secrets),
            )
            self._remove_leftover(client, kwargs["name"], job.job_id)
            try:
                container = client.containers.create(**kwargs)
            except ImageNotFound:
                raise BackendError(
                    f"{what}: the image {kwargs['image']!r} does not exist in the engine at "
                    f"{self.url} (`rhizome image build` builds the learner image)"
                ) from None
            # Created (and so labelled) before it starts: a rollback finds it either way.
            container.start()
            state = ContainerState(
                id=str(container.id),
                name=kwargs["name"],
                rank=rank,
                generation=job.generation,
                running=True,
            )
        self.watch(job.job_id).note(state)
        return handle_of(state.id)

    def _remove_leftover(self, client: docker.DockerClient, name: str, job_id: str) -> None:
        """A container already named so: ours (an earlier run of this rank) goes; anyone
        else's is a clash we must not resolve by deleting it."""
        try:
            other = client.containers.get(name)
        except NotFound:
            return
        owner = (other.labels or {}).get(LABEL_JOB)
        if owner != job_id:
            raise BackendError(
                f"a container named {name} already exists and is not this job's "
                f"(its {LABEL_JOB} label is {owner!r}); remove it or rename it"
            )
        # An earlier run of this rank (its controller died, the learner starts again):
        # renamed, not removed, so that the job's log collector can still read its last
        # lines; its labels stay, and the job's rollback removes it with the rest.
        with contextlib.suppress(NotFound):
            if other.status in ("running", "restarting", "paused"):
                other.kill()
            other.rename(f"{name}-x{str(other.id)[:12]}")

    def _ensure_network(self, client: docker.DockerClient, job_id: str) -> str:
        name = network_name(job_id)
        if not client.networks.list(names=[name]):
            client.networks.create(name, driver="bridge", labels={LABEL_JOB: job_id})
        return name

    def renew_tls(self, job: JobSpec, tls: dict[str, str]) -> None:
        """Hand a renewed TDS client certificate to the job's running parts, as the local
        backend does: `learners/<rank>/tds-tls.json` (contract.credentials.TDS_TLS_FILE),
        which each re-reads (`RenewingStub`), under the log collector's directory (a
        process of this host shipping the containers' streams, one collector per rank
        there; its environment holds only the first certificate) and under the job's
        directory, which each container mounts read-write at the same path (the
        controller inside ships the metrics read from files). A learner's file is written
        atomically for the container's uid, never through a link a learner left there."""
        data = json.dumps(tls).encode()
        owner = (self.options.uid, self.options.gid) if self.chown else None
        for rank in range(job.learners):
            parts = ["learners", str(rank)]
            for root, who, what in (
                (self.helper_dir(job.job_dir), None, f"the log collector of learner {rank}"),
                (Path(job.job_dir), owner, f"learner {rank}"),
            ):
                try:
                    root.mkdir(parents=True, exist_ok=True, mode=0o700)
                    isolation.write_file(root, parts, TDS_TLS_FILE, data, 0o600, who)
                except (OSError, isolation.UnsafePath) as exc:
                    raise BackendError(
                        f"job {job.job_id}: cannot renew {what}'s TDS certificate: {exc}"
                    ) from exc

    # -- the per-job helper: the container log collector --------------------------------
    @staticmethod
    def helper_dir(job_dir: str) -> Path:
        """The job's log collector's state (offsets per rank, its lock): beside the jobs'
        directories, not in the job's own, which its containers mount read-write."""
        return Path(job_dir).parent / ".container-logs" / Path(job_dir).name

    def helper_running(self, job_dir: str) -> procs.ProcRef | None:
        """The job's log collector, if one holds its lock (it holds it until it exits)."""
        lock = self.helper_dir(job_dir) / LOCK_FILE
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                with contextlib.suppress(ValueError, OSError):
                    held = json.loads(os.pread(fd, 4096, 0) or b"{}")
                    return procs.ProcRef(int(held["pid"]), int(held["start"]))
                return procs.ProcRef(0, -1)  # held, by a collector still writing its pid
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def start_helper(self, job: JobSpec) -> None:
        """The job's log collector (`python -m learner.controller.container_logs`), a
        process of this host beside the guardian, unless one runs already. Idempotent:
        the guardian calls it again while it watches the job, so a collector that died
        (or was killed) starts again and resumes from its offsets, exactly once.

        A process rather than a container with the engine's socket: the socket is root on
        the host, and the collector needs nothing a container would give it."""
        if not job.tds_address:
            return  # no TDS configured (the api and lcm alone): nothing to ship to
        if self.helper_running(job.job_dir) is not None:
            return
        ours = self._helpers.get(job.job_id)
        if ours is not None and ours.ref.alive():
            return  # started, not holding its lock yet
        with self._lock:
            last = self._helper_started.get(job.job_id, 0.0)
            if time.monotonic() - last < _HELPER_RESTART_S:
                return  # one that just started may not hold its lock yet; or it keeps dying
            self._helper_started[job.job_id] = time.monotonic()
        state = self.helper_dir(job.job_dir)
        state.mkdir(parents=True, exist_ok=True, mode=0o700)
        argv = [
            sys.executable,
            "-m",
            "learner.controller.container_logs",
            f"--job-id={job.job_id}",
            f"--state-dir={state}",
            f"--tds={job.tds_address}",
            f"--docker-host={self.url}",
            f"--drain-timeout-s={_HELPER_DRAIN_S}",
        ]
        if job.manifest.metric_sources is not None:
            argv.append(f"--metric-sources={json.dumps(job.manifest.metric_sources)}")
        env = {k: v for k, v in os.environ.items() if not k.startswith(_PLATFORM_PREFIX)}
        env[TDS_TOKEN_ENV] = job.tds_token  # the environment, not argv: argv is public
        if job.tds_tls:  # the job's TDS client certificate, when the internal port is mTLS
            env[COLLECTOR_TLS_ENV] = json.dumps(job.tds_tls)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
        try:
            log_fd = os.open(state / "collector.log", flags, 0o600)
            with os.fdopen(log_fd, "ab") as logf:
                proc = subprocess.Popen(
                    argv,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,  # outlives a guardian killed under it
                )
        except OSError as exc:
            raise BackendError(f"job {job.job_id}: cannot start its log collector: {exc}") from exc
        if self.reaper is not None:
            self.reaper.watch(proc.pid, lambda pid, code: None)
        ref = procs.ProcRef.of(proc.pid) or procs.ProcRef(proc.pid, -1)
        with self._lock:
            self._helpers[job.job_id] = _Helper(ref, argv, env)
        log.info("job %s: log collector started (pid %d)", job.job_id, proc.pid)

    def stop_helper(self, job_id: str, job_dir: str) -> None:
        """SIGTERM the job's log collector, which ships what the engine holds (containers
        that exited included) and exits; SIGKILL it if it has not within the drain time.
        When none runs but this process started one for the job (a collector that died),
        a drain (`--once`) runs instead. Called before the job's containers are removed,
        so their last lines are read."""
        ours = self._helpers.get(job_id)
        ref = self.helper_running(job_dir)
        if ref is None and ours is not None and ours.ref.alive():
            # Just started: it takes its lock within a second or two (its imports).
            deadline = time.monotonic() + 20
            while ref is None and ours.ref.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
                ref = self.helper_running(job_dir)
        if ref is not None:
            self._terminate_helpers(job_id, job_dir, ref)
            return
        if ours is None:
            return  # not ours to drain: we do not know its TDS (a predecessor's deploy)
        log.info("job %s: no log collector runs; draining the containers' logs once", job_id)
        try:
            subprocess.run(
                [*ours.argv, "--once"],
                env=ours.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=_HELPER_DRAIN_S + 10,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("job %s: draining its logs failed: %s", job_id, exc)

    def _terminate_helpers(self, job_id: str, job_dir: str, ref: procs.ProcRef | None) -> None:
        signalled: procs.ProcRef | None = None
        deadline = time.monotonic() + _HELPER_DRAIN_S + 10
        while ref is not None:
            # A collector that waited for the lock holds it next: it is signalled too.
            if ref != signalled and ref.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(ref.pid, signal.SIGTERM)
                signalled = ref
            if time.monotonic() > deadline:
                log.warning("job %s: its log collector did not drain in time; killing it", job_id)
                if ref.alive():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(ref.pid, signal.SIGKILL)
                return
            time.sleep(0.1)
            ref = self.helper_running(job_dir)

    # -- what runs -----------------------------------------------------------------------
    def learner_exited(self, handle: int) -> int | None:
        prefix = id_prefix(handle)
        for watch in list(self._watches.values()):
            state = watch.find(prefix)
            if state is not None:
                if state.running:
                    return None
                if state.exit_code is not None:
                    return state.exit_code
                return 137 if state.removed else None
        return None

    def controller_alive(self, job_id: str, rank: int, status: dict[str, Any]) -> bool:
        """A controller's pid is its container's own; alive means a running container of
        the rank. While the engine's stream is down we cannot tell: answer alive, and
        let the controller's lease expire if it really died."""
        watch = self.watch(job_id)
        if not watch.synced.wait(timeout=2.0):
            return True
        return any(s.running and s.rank == rank for s in watch.states())

    def _oom_states(self, job_id: str, rank: int) -> list[ContainerState]:
        """The rank's containers the engine reported out of memory (events, else inspect)."""
        oom = [s for s in self.watch(job_id).states() if s.rank == rank and s.oom]
        if not oom:
            with contextlib.suppress(*_ENGINE_ERRORS):
                client = self.client()
                for summary in client.api.containers(all=True, filters=job_filter(job_id, rank)):
                    attrs = client.api.inspect_container(summary["Id"])
                    if (attrs.get("State") or {}).get("OOMKilled"):
                        oom.append(ContainerState.from_attrs(attrs))
        return oom

    def out_of_memory(self, job_id: str, rank: int) -> bool:
        return bool(self._oom_states(job_id, rank))

    def exit_note(self, job_id: str, rank: int) -> str:
        oom = self._oom_states(job_id, rank)
        if not oom:
            return ""
        limit = ""
        with contextlib.suppress(*_ENGINE_ERRORS):
            attrs = self.client().api.inspect_container(oom[-1].id)
            memory = int((attrs.get("HostConfig") or {}).get("Memory") or 0)
            limit = f" of {memory // (1024 * 1024)} MiB" if memory else ""
        return f"out of memory: the learner's container hit its memory limit{limit} (OOM kill)"

    def running(self, job_id: str) -> list[int]:
        with self.engine(f"job {job_id}: listing containers") as client:
            found = client.api.containers(filters={**job_filter(job_id), "status": "running"})
        return [handle_of(str(c["Id"])) for c in found]

    def log_tail(self, job_dir: str, rank: int, lines: int = 20) -> list[str]:
        """The rank's last lines from its newest container's streams (stderr, then stdout,
        as the local backend's files); the job directory's files when there are any."""
        job_id = Path(job_dir).name
        out: list[str] = []
        with contextlib.suppress(*_ENGINE_ERRORS):
            client = self.client()
            found = client.api.containers(all=True, filters=job_filter(job_id, rank))
            newest = sorted(found, key=lambda c: int(c.get("Created") or 0))[-1:]
            for c in newest:
                for stream in ("stderr", "stdout"):
                    raw = client.api.logs(
                        c["Id"], stdout=stream == "stdout", stderr=stream == "stderr", tail=lines
                    )
                    text = raw.decode(errors="replace").splitlines()
                    out.extend(f"[{stream}] {line}" for line in text[-lines:])
                    if len(out) >= lines:
                        break
        return out[-lines:] or tail_logs(job_dir, rank, lines)

    # -- undo ------------------------------------------------------------------------------
    def stop_learners(self, job_id: str, grace_s: float) -> None:
        """SIGTERM every running container of the job (docker-init passes it to the
        controller), SIGKILL after the grace; all containers at once."""
        with self.engine(f"job {job_id}: stopping learners") as client:
            found = client.api.containers(filters={**job_filter(job_id), "status": "running"})
            timeout = max(1, int(grace_s + 0.999))
            threads = [
                threading.Thread(target=self._stop_one, args=(client, str(c["Id"]), timeout))
                for c in found
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

    def stop_learner(self, job_id: str, rank: int, grace_s: float) -> None:
        """SIGTERM the rank's running container (an elastic job's scale-in: its worker
        leaves at the end of a mini-batch), SIGKILL after the grace; the others run on."""
        with self.engine(f"job {job_id}: stopping learner {rank}") as client:
            found = client.api.containers(filters={**job_filter(job_id, rank), "status": "running"})
            for summary in found:
                self._stop_one(client, str(summary["Id"]), max(1, int(grace_s + 0.999)))

    @staticmethod
    def _stop_one(client: docker.DockerClient, cid: str, timeout: int) -> None:
        with contextlib.suppress(NotFound, *_ENGINE_ERRORS):
            client.api.stop(cid, timeout=timeout)

    def _remove_labelled(self, client: docker.DockerClient, job_id: str) -> None:
        for summary in client.api.containers(all=True, filters=job_filter(job_id)):
            with contextlib.suppress(NotFound):
                client.api.remove_container(summary["Id"], force=True, v=True)
        for volume in client.volumes.list(filters=job_filter(job_id)):
            with contextlib.suppress(NotFound):
                volume.remove(force=True)
        for network in client.networks.list(filters=job_filter(job_id)):
            with contextlib.suppress(NotFound):
                network.remove()

    @staticmethod
    def _pending_dir(job_dir: str) -> Path:
        """Rollbacks the engine could not take, by job id, beside the jobs' directories."""
        return Path(job_dir).parent / ".engine-rollbacks"

    def finish_pending_rollbacks(self, client: docker.DockerClient, jobs_dir: Path) -> None:
        """Remove what jobs left in an engine that was down when they were rolled back:
        its containers are stopped, not gone, once it is back. Run by every deploy."""
        pending = jobs_dir / ".engine-rollbacks"
        if not pending.is_dir():
            return
        for marker in sorted(pending.iterdir()):
            with contextlib.suppress(NotFound, *_ENGINE_ERRORS):
                running = {**job_filter(marker.name), "status": "running"}
                if client.api.containers(filters=running):
                    continue  # deployed again since: its own rollback will clear the note
                self._remove_labelled(client, marker.name)
                marker.unlink()
                log.info("job %s: removed what it left while the engine was down", marker.name)

    def rollback(self, job_id: str, job_dir: str) -> None:
        """Remove every container, volume and network labelled with the job; then the
        deploy's files. Safe at any point and any number of times. An engine that does
        not answer is logged, not raised, and the job noted in `<jobs>/.engine-rollbacks`:
        the next deploy that reaches the engine removes what the job left there."""
        # The collector reads what the containers printed up to their end before they go.
        self.stop_helper(job_id, job_dir)
        try:
            self._remove_labelled(self.client(), job_id)
            with contextlib.suppress(FileNotFoundError):
                (self._pending_dir(job_dir) / job_id).unlink()
        except APIError as exc:
            raise BackendError(f"job {job_id}: rollback: {exc.explanation}") from exc
        except _ENGINE_ERRORS as exc:
            log.warning(
                "job %s: rollback could not reach the engine at %s: %s", job_id, self.url, exc
            )
            pending = self._pending_dir(job_dir)
            pending.mkdir(parents=True, exist_ok=True)
            (pending / job_id).write_text(self.url)
        store = self.remote_store()
        if store is not None:
            # Whatever the containers were given stops working now, not at its expiry.
            try:
                store.revoke(job_id)
            except ObjectStoreError as exc:
                raise BackendError(f"job {job_id}: rollback: {exc}") from exc
        remove_deploy_files(job_dir)
        shutil.rmtree(self.secrets_file(job_dir).parent, ignore_errors=True)

    def close(self) -> None:
        for watch in list(self._watches.values()):
            watch.stop()
        self._watches.clear()
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    """Hand a job's files to the learner user (only what is not theirs yet)."""
    if not root.exists():
        return
    for path in (root, *root.rglob("*")):
        with contextlib.suppress(OSError):
            st = path.lstat()
            if st.st_uid != uid or st.st_gid != gid:
                os.lchown(path, uid, gid)


register_backend("docker", DockerBackend)

__all__ = ["DockerBackend"]
