"""Where learners run: the backend interface and the registry of backends by name.

Modelled on torch.distributed.elastic's rendezvous handler registry: a backend is built
by name (`get_backend("local", ...)`), so the guardian never depends on one, and docker or
kubernetes backends only have to register themselves.

A backend deploys the steps the guardian records in etcd (volume, secrets, learners,
helper) and undoes them: `rollback` must remove everything labelled with the job id and
be safe to call any number of times, at any point of a deploy.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from contract import procs
from contract.learner_spec import DEFAULT_LEARNER_LEASE_TTL_S
from contract.registry import Registry
from services.manifest import Manifest


class BackendError(RuntimeError):
    """A deploy step failed; the guardian rolls back and retries."""


class RenewalUnsupported(BackendError):
    """The backend cannot hand running learners a renewed certificate at all (not a
    failure of one attempt): the guardian stops asking."""


class UnknownBackend(ValueError):
    """No backend is registered under the name; the message lists those that are."""


@dataclass
class JobSpec:
    """What a backend needs to know to run a job's learners."""

    job_id: str
    command: str
    learners: int
    job_dir: str
    checkpoint_dir: str
    result_store: str
    etcd_url: str
    manifest: Manifest  # the job's typed manifest (services/manifest)
    generation: int = 1
    model_zip: str = ""
    placement: dict[str, Any] = field(default_factory=dict)
    gpus_per_learner: float = 0.0
    memory_mb: float = 0.0
    master_port: int = 0
    tds_address: str = ""
    tds_token: str = field(default="", repr=False)  # the learners' job token, never logged
    # The learners' mutual-TLS client certificate for the TDS (`{ca, cert, key}` PEM text;
    # empty on a plaintext platform): LearnerSpec.tds_tls.
    tds_tls: dict[str, str] = field(default_factory=dict, repr=False)
    # The job's own etcd user, `USER:PASSWORD` (LearnerSpec.etcd_credentials); empty where
    # etcd has no authentication.
    etcd_credentials: str = field(default="", repr=False)
    # SIGTERM -> SIGKILL delay when the platform stops a learner (the manifest's
    # checkpoint.grace_s, else the guardian's default); learners are told it.
    grace_s: float = 10.0
    # The TTL of each learner controller's etcd lease (LearnerSpec.lease_ttl_s; the
    # platform's `RHIZOME_LEARNER_LEASE_TTL_S`, docs/lifecycle.md).
    learner_lease_ttl_s: int = DEFAULT_LEARNER_LEASE_TTL_S
    # Set by the platform on every learner (e.g. the preemption estimates for the
    # checkpoint policy); a manifest's own `env` cannot override them.
    platform_env: dict[str, str] = field(default_factory=dict)


_Call = TypeVar("_Call", bound=Callable[..., Any])


def cannot_block(method: _Call) -> _Call:
    """Marks a backend call that returns at once whatever the machine's state: it reads
    memory or /proc, starts nothing and waits on no engine, network or watch. TimedBackend
    runs such a call in its caller's thread instead of on its pool (a hop to another
    thread and back costs more than the call itself: issue #18, two hops in every hosted
    guardian's monitoring round). The mark is the method's own: a subclass that overrides
    a marked call is timed again unless its override is marked too."""
    method.cannot_block = True  # type: ignore[attr-defined]
    return method


class Backend(abc.ABC):
    name: str = ""
    # Whether `renew_tls` reaches running learners: the LCM then issues a job's TDS
    # certificate for 24 h, not for as long as a daemon's (services/lcm/hosting.py).
    renews_tls: bool = False

    @abc.abstractmethod
    def prepare_volume(self, job: JobSpec) -> None:
        """The job's directory (code, logs, checkpoints, results) exists and is clean."""

    @abc.abstractmethod
    def write_secrets(self, job: JobSpec) -> None:
        """Data-store credentials, readable by the job's learners only."""

    @abc.abstractmethod
    def start_learner(self, job: JobSpec, rank: int, restart: int = 0) -> int:
        """Start the controller of learner `rank`; returns a handle (a pid locally)."""

    @abc.abstractmethod
    def start_helper(self, job: JobSpec) -> None:
        """Per-job helper (FfDL's log collector / controller sidecar), if the backend needs
        one. Idempotent: the guardian calls it again while it watches a deployed job (also
        one it took over), so a helper that died is started again."""

    def stop_helper(self, job_id: str, job_dir: str) -> None:  # noqa: B027 - optional hook
        """Stop the per-job helper, letting it finish its work (the platform is shutting
        down and the job stays; `rollback` stops it too)."""

    def renew_tls(self, job: JobSpec, tls: dict[str, str]) -> None:
        """Hand the job's running learners (and its log helper) their next TDS client
        certificate (`{ca, cert, key}`) where their log collector re-reads it
        (`contract.credentials.tds_tls_file`: `<learner dir>/tds-tls.json` on the local
        and docker backends, a Secret volume on Kubernetes). A failed attempt raises
        `BackendError` (the guardian tries again later); a backend that cannot renew at
        all raises `RenewalUnsupported`, and the guardian logs it once and stops asking."""
        raise RenewalUnsupported(
            f"the {type(self).__name__} cannot renew running learners' certificates"
        )

    @abc.abstractmethod
    def learner_exited(self, handle: int) -> int | None:
        """The exit code of a learner controller this process started, once it ended."""

    @abc.abstractmethod
    def stop_learners(self, job_id: str, grace_s: float) -> None:
        """SIGTERM-then-kill every running learner of the job (halt, delete, failure)."""

    def stop_learner(self, job_id: str, rank: int, grace_s: float) -> None:
        """SIGTERM-then-kill one learner (an elastic job's scale-in). A backend that
        cannot stop one learner alone refuses, and the scale is rolled back."""
        raise BackendError(
            f"the {type(self).__name__} cannot stop one learner alone: scale this job in "
            "by halting it, scaling it while halted and resuming it"
        )

    @abc.abstractmethod
    def rollback(self, job_id: str, job_dir: str) -> None:
        """Remove everything a deploy created (idempotent); checkpoints and logs stay."""

    @abc.abstractmethod
    def running(self, job_id: str) -> list[int]:
        """What still runs for the job (pids locally); empty after rollback/teardown."""

    @abc.abstractmethod
    def log_tail(self, job_dir: str, rank: int, lines: int = 20) -> list[str]:
        """The last lines a learner wrote (stderr, then stdout), for a failed job's record."""

    @cannot_block  # a read of /proc/<pid>/stat
    def controller_alive(self, job_id: str, rank: int, status: dict[str, Any]) -> bool:
        """Whether the controller that wrote this learner status (its etcd value, with the
        `pid` and `start` it saw) still runs. Locally that pid is ours to check; a backend
        whose controllers live in other pid namespaces (containers) answers from its own
        view of them."""
        return procs.ref_alive(status.get("pid"), status.get("start"))

    def release(self, job_id: str, job_dir: str, result_store: str) -> None:
        """Job `job_id` ended for good (completed, failed, deleted): give back what it
        held for its whole life, across halts and redeploys (locally: its learner uid).
        Idempotent; most backends hold nothing such."""
        return None

    def release_ended(
        self, jobs_dir: Path, objects_dir: Path, ended: Callable[[str], bool]
    ) -> None:
        """At a guardian's start: `release` every job this backend still holds something
        for that `ended` says is over (a guardian that died before releasing)."""
        return None

    def exit_note(self, job_id: str, rank: int) -> str:
        """Why learner `rank`'s last run ended, when the backend knows more than its exit
        code (e.g. an out-of-memory kill); empty otherwise."""
        return ""

    def out_of_memory(self, job_id: str, rank: int) -> bool:
        """Whether learner `rank`'s last run was killed for exceeding its memory limit.
        Its exit code (137, SIGKILL) looks like a preemption's; the guardian counts it as
        the job's own failure instead (max_learner_restarts, not max_preemptions)."""
        return False


BackendFactory = Callable[..., Backend]
BACKENDS: Registry[BackendFactory] = Registry("learner backend", error=UnknownBackend)
# Registered lazily by module path so that importing the registry stays cheap.
BACKENDS.register("local", "services.backends.local.backend:LocalBackend")
BACKENDS.register("docker", "services.backends.docker.backend:DockerBackend")
BACKENDS.register("kubernetes", "services.backends.kubernetes.backend:KubernetesBackend")
# Learners that train nothing, for control-plane benchmarks (benchmarks/control_plane_scale.py).
BACKENDS.register("simulated", "services.backends.simulated.backend:SimulatedBackend")


def register_backend(name: str, factory: BackendFactory | str) -> None:
    BACKENDS.register(name, factory)


def get_backend(name: str, **kwargs: Any) -> Backend:
    return BACKENDS.get(name)(**kwargs)


def backend_names() -> list[str]:
    return BACKENDS.names()


# -- timeouts on backend calls (a guardian host: docs/control-plane-scale.md) ------------
class BackendTimeout(BackendError):
    """A backend call did not return within its timeout. The call goes on in a thread of
    its own (a Python thread cannot be stopped); its caller gets this instead, and the
    thread that waited is free again."""


# How long each kind of call may take before its caller gives up on it (seconds). Deploy
# steps and teardown get room for a slow engine (an image, a volume, containers stopping);
# the questions a monitor step asks every round (is it alive, has it exited) get less.
# `stop_learners` / `stop_learner` get their grace period on top of theirs.
CALL_TIMEOUTS_S: dict[str, float] = {
    "prepare_volume": 120.0,
    "write_secrets": 60.0,
    "start_learner": 120.0,
    "start_helper": 60.0,
    "stop_helper": 60.0,
    "renew_tls": 60.0,
    "learner_exited": 30.0,
    "stop_learners": 60.0,
    "stop_learner": 60.0,
    "rollback": 120.0,
    "running": 30.0,
    "log_tail": 30.0,
    "controller_alive": 30.0,
    "release": 60.0,
    "release_ended": 300.0,
    "exit_note": 30.0,
    "out_of_memory": 30.0,
}
# At most this many backend calls run at once in a TimedBackend; more wait their turn
# (inside their own timeout). Calls stuck past their timeout keep their threads, so a
# backend that hangs every call degrades to timeouts, never to a stuck caller.
TIMED_CALL_THREADS = 32


class TimedBackend(Backend):
    """`backend`, with every call bounded by `CALL_TIMEOUTS_S` (or `timeouts`): the call
    runs on a pool of the wrapper's own, and its caller (a guardian host's step or deploy
    thread) waits at most the timeout, then gets `BackendTimeout` naming the call, the
    job and the limit. `on_timeout(message)` is told first, in the caller's thread (the
    host writes it into the job's history). A call that has not started by its deadline is
    cancelled; one that has runs on, holding a thread of this pool only."""

    def __init__(
        self,
        backend: Backend,
        timeouts: dict[str, float] | None = None,
        on_timeout: Callable[[str], None] | None = None,
        threads: int = TIMED_CALL_THREADS,
    ) -> None:
        self.backend = backend
        self.name = backend.name
        self.renews_tls = backend.renews_tls
        self.timeouts = {**CALL_TIMEOUTS_S, **(timeouts or {})}
        self.on_timeout = on_timeout
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="backend")

    def _call(self, kind: str, job: str, extra_s: float, *args: Any) -> Any:
        method = getattr(self.backend, kind)
        if getattr(method, "cannot_block", False):
            return method(*args)  # nothing to wait for: no hop to the pool (cannot_block)
        limit = self.timeouts[kind] + extra_s
        future = self._pool.submit(method, *args)
        try:
            return future.result(timeout=limit)
        except FutureTimeout:
            future.cancel()
            message = (
                f"backend call {kind} for job {job} did not return within {limit:g} s "
                f"(the {self.backend.name or type(self.backend).__name__} backend is stuck "
                "or too slow); given up on"
            )
            if self.on_timeout is not None:
                self.on_timeout(message)
            raise BackendTimeout(message) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __getattr__(self, name: str) -> Any:
        # What only some backends have (not part of the interface): theirs, untimed.
        if name == "backend":
            raise AttributeError(name)
        return getattr(self.backend, name)

    def prepare_volume(self, job: JobSpec) -> None:
        self._call("prepare_volume", job.job_id, 0.0, job)

    def write_secrets(self, job: JobSpec) -> None:
        self._call("write_secrets", job.job_id, 0.0, job)

    def start_learner(self, job: JobSpec, rank: int, restart: int = 0) -> int:
        return int(self._call("start_learner", job.job_id, 0.0, job, rank, restart))

    def start_helper(self, job: JobSpec) -> None:
        self._call("start_helper", job.job_id, 0.0, job)

    def stop_helper(self, job_id: str, job_dir: str) -> None:
        self._call("stop_helper", job_id, 0.0, job_id, job_dir)

    def renew_tls(self, job: JobSpec, tls: dict[str, str]) -> None:
        self._call("renew_tls", job.job_id, 0.0, job, tls)

    def learner_exited(self, handle: int) -> int | None:
        code = self._call("learner_exited", f"(learner handle {handle})", 0.0, handle)
        return None if code is None else int(code)

    def stop_learners(self, job_id: str, grace_s: float) -> None:
        self._call("stop_learners", job_id, grace_s, job_id, grace_s)

    def stop_learner(self, job_id: str, rank: int, grace_s: float) -> None:
        self._call("stop_learner", job_id, grace_s, job_id, rank, grace_s)

    def rollback(self, job_id: str, job_dir: str) -> None:
        self._call("rollback", job_id, 0.0, job_id, job_dir)

    def running(self, job_id: str) -> list[int]:
        return list(self._call("running", job_id, 0.0, job_id))

    def log_tail(self, job_dir: str, rank: int, lines: int = 20) -> list[str]:
        return list(self._call("log_tail", Path(job_dir).name, 0.0, job_dir, rank, lines))

    def controller_alive(self, job_id: str, rank: int, status: dict[str, Any]) -> bool:
        return bool(self._call("controller_alive", job_id, 0.0, job_id, rank, status))

    def release(self, job_id: str, job_dir: str, result_store: str) -> None:
        self._call("release", job_id, 0.0, job_id, job_dir, result_store)

    def release_ended(
        self, jobs_dir: Path, objects_dir: Path, ended: Callable[[str], bool]
    ) -> None:
        self._call("release_ended", "(all ended jobs)", 0.0, jobs_dir, objects_dir, ended)

    def exit_note(self, job_id: str, rank: int) -> str:
        return str(self._call("exit_note", job_id, 0.0, job_id, rank))

    def out_of_memory(self, job_id: str, rank: int) -> bool:
        return bool(self._call("out_of_memory", job_id, 0.0, job_id, rank))
