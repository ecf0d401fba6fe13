"""Every environment variable a learner receives, as one typed record.

A backend builds a `LearnerEnv` and writes it with `to_environ()`; the learner reads it
back with `LearnerEnv.from_environ(os.environ)`. A missing or malformed variable raises
`LearnerConfigError` naming the variable and what is wrong; a learner entry point prints
that one line and exits with `ExitCode.CONFIG_ERROR`.

Written by the platform (the local backend, from the guardian's job spec):

| variable | field | meaning | default |
| --- | --- | --- | --- |
| `RHIZOME_JOB_ID` | `job_id` | job id; with `RHIZOME_CHECKPOINT_DIR` it turns the checkpoint SDK on | unset |
| `RHIZOME_RANK` | `rank` | learner rank (also a process label) | unset |
| `RHIZOME_ROLE` | `role` | process label: `controller` or `learner` | unset |
| `RHIZOME_LEARNER_ID` | `learner_id` | learner id, namespaced in the checkpoint store | `0` |
| `RHIZOME_JOB_DIR` | `job_dir` | the job's directory | unset |
| `RHIZOME_CHECKPOINT_DIR` | `checkpoint_dir` | checkpoint store root (a local directory) | `.rhizome/checkpoints` |
| `RHIZOME_RESULT_DIR` | `result_dir` | copied to the result store when the learner ends | `<job_dir>/results` |
| `RHIZOME_SECRETS` | `secrets` | file of data-store credentials | unset |
| `RHIZOME_MTTP_S` | `mttp_s` | platform's mean time to preemption (instance type + zone) | `3600` |
| `RHIZOME_RESTART_S` | `restart_s` | platform's mean restart time R (allocation + preparation) | `300` |
| `RHIZOME_JOIN_TOKEN` | `join_token` | a pipeline learner started as a replacement: its admission token (the runtime gets it as `RHIZOME_RUNTIME_JOIN_TOKEN`) | unset |
| `RHIZOME_ELASTIC_ETCD` | `elastic_etcd` | an elastic job's learner (manifest `elastic:`): the etcd URL its workers coordinate through (`learner.elastic.join` reads it, with `RHIZOME_JOB_ID`) | unset |
| `RHIZOME_ETCD_CREDENTIALS_FILE` | (read by `contract.etcd.EtcdClient`) | a 0600 `USER:PASSWORD` file: the etcd user of the job (never the platform's), written by the learner controller for its command when etcd requires authentication | unset: no authentication |
| `RHIZOME_TDS_TLS_DIR` | (read by `contract.credentials.tds_tls_file`) | the directory holding the job's renewed TDS client certificate (`tds-tls.json`): a Secret volume on Kubernetes; elsewhere unset and the file is in the learner directory | unset |

Checkpointing knobs (a manifest's `env` may set them; the backend passes them on):

| variable | field | meaning | default |
| --- | --- | --- | --- |
| `RHIZOME_GRACE_S` | `grace_s` | grace after SIGTERM before SIGKILL | `30` |
| `RHIZOME_BACKUP_URL` | `backup_url` | back up there instead: `s3://bucket/prefix` or a path | unset |
| `RHIZOME_S3_ENDPOINT_URL` | `s3_endpoint_url` | S3-compatible server for `s3://` stores | unset |
| `RHIZOME_NOTICE_SOURCES` | `notice_sources` | comma list of `sigterm,aws,azure,gcp` | `sigterm` |
| `RHIZOME_METADATA_URL` | `metadata_url` | cloud metadata base URL (tests: 127.0.0.1) | `http://169.254.169.254` |
| `RHIZOME_NOTICE_POLL_S` | `notice_poll_s` | metadata polling period | `1` |
| `RHIZOME_SAVE_S` | `save_s` | prior for the save time δ until measured | `10` |
| `RHIZOME_BACKUP_S` | `backup_s` | prior for the backup time β until measured | `10` |
| `RHIZOME_INSURANCE` | `insurance` | `auto`, `always` or `never` | `auto` |
| `RHIZOME_PERIODIC_EVERY_S` | `periodic_every_s` | the script's own save period, if declared | unset (learned) |
| `RHIZOME_KEEP` | `keep` | committed periodic checkpoints kept besides the newest | `1` |
| `RHIZOME_EMERGENCY_EXIT` | `emergency_exit` | exit (143) after an emergency save (`1`) or go on (`0`) | `1` |

From the manifest's `checkpoint:` and `pipeline:` sections (the backend writes them; a
variable the manifest's `env:` sets explicitly wins over the section, except the grace,
which is the platform's own SIGTERM -> SIGKILL delay and so always the truth):

| variable | field | from | default |
| --- | --- | --- | --- |
| `RHIZOME_CHECKPOINT_POLICY` | `checkpoint_policy` | `checkpoint.policy`: `adaptive`, `fixed` or `none` | `adaptive` |
| `RHIZOME_CHECKPOINT_INTERVAL_S` | `checkpoint_interval_s` | `checkpoint.interval_s` | unset |
| `RHIZOME_KEEP` | `keep` | `checkpoint.keep` − 1 (the section counts the newest too) | |
| `RHIZOME_GRACE_S` | `grace_s` | `checkpoint.grace_s`, else the platform's grace | |
| `RHIZOME_PIPELINE_STAGES` | `pipeline_stages` | `pipeline.stages` | unset |
| `RHIZOME_PIPELINE_PIPELINES` | `pipeline_pipelines` | `pipeline.pipelines` | unset |
| `RHIZOME_PIPELINE_REDUNDANCY` | `pipeline_redundancy` | `pipeline.redundancy` | unset |
| `RHIZOME_PIPELINE_MICROBATCHES` | `pipeline_microbatches` | `pipeline.microbatches` | unset |
| `RHIZOME_PIPELINE_METRICS_EVERY` | `pipeline_metrics_every` | `pipeline.metrics_every` | unset (1) |

Written for each pipeline runtime worker (`RuntimeEnv`, field `runtime`), all prefixed
`RHIZOME_RUNTIME_`: `WORKER`, `STAGES`, `PIPELINES`, `STORE`, `ETCD`, `JOB_ID` (required),
`BACKEND`, `DEVICE`, `DETECTION_TIMEOUT`, `LEASE_TTL`, `OUT_DIR`, `KILL`, `REDUNDANCY`,
`MICROBATCHES`, `THREADS`, `JOIN_TOKEN`, `CHECKPOINT_DIR`, `CHECKPOINT_EVERY`,
`METRICS_FILE`, `METRICS_EVERY`. Off the platform the runtime's launcher writes them
(`STORE` is its TCPStore's `HOST:PORT`); on the platform the learner controller of a pipeline job writes
them for its command (`RuntimeEnv.for_learner`: worker = rank, the shape from the
`pipeline:` section, `STORE=etcd`: the rendezvous store lives in the platform's etcd,
`METRICS_FILE` in the learner's directory, where the job's metric source reads it:
contract/runtime_metrics.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from contract import runtime_metrics

PREFIX = "RHIZOME_"

JOB_ID = "RHIZOME_JOB_ID"
RANK = "RHIZOME_RANK"
ROLE = "RHIZOME_ROLE"
LEARNER_ID = "RHIZOME_LEARNER_ID"
JOB_DIR = "RHIZOME_JOB_DIR"
CHECKPOINT_DIR = "RHIZOME_CHECKPOINT_DIR"
RESULT_DIR = "RHIZOME_RESULT_DIR"
SECRETS = "RHIZOME_SECRETS"
MTTP_S = "RHIZOME_MTTP_S"
RESTART_S = "RHIZOME_RESTART_S"
JOIN_TOKEN = "RHIZOME_JOIN_TOKEN"
ELASTIC_ETCD = "RHIZOME_ELASTIC_ETCD"
# The etcd user every `contract.etcd.EtcdClient` of a process authenticates as, when
# etcd runs with authentication (`rhizome up`): the path of a 0600 `USER:PASSWORD` file.
# The platform's processes get the platform user's; a learner controller writes its
# job's own user (from its spec) to a file and names it here for its command, so the
# runtime's store, its cluster state and the elastic worker authenticate unchanged.
ETCD_CREDENTIALS_FILE = "RHIZOME_ETCD_CREDENTIALS_FILE"
GRACE_S = "RHIZOME_GRACE_S"
BACKUP_URL = "RHIZOME_BACKUP_URL"
S3_ENDPOINT_URL = "RHIZOME_S3_ENDPOINT_URL"
NOTICE_SOURCES = "RHIZOME_NOTICE_SOURCES"
METADATA_URL = "RHIZOME_METADATA_URL"
NOTICE_POLL_S = "RHIZOME_NOTICE_POLL_S"
SAVE_S = "RHIZOME_SAVE_S"
BACKUP_S = "RHIZOME_BACKUP_S"
INSURANCE = "RHIZOME_INSURANCE"
PERIODIC_EVERY_S = "RHIZOME_PERIODIC_EVERY_S"
KEEP = "RHIZOME_KEEP"
EMERGENCY_EXIT = "RHIZOME_EMERGENCY_EXIT"
CHECKPOINT_POLICY = "RHIZOME_CHECKPOINT_POLICY"
CHECKPOINT_INTERVAL_S = "RHIZOME_CHECKPOINT_INTERVAL_S"
PIPELINE_STAGES = "RHIZOME_PIPELINE_STAGES"
PIPELINE_PIPELINES = "RHIZOME_PIPELINE_PIPELINES"
PIPELINE_REDUNDANCY = "RHIZOME_PIPELINE_REDUNDANCY"
PIPELINE_MICROBATCHES = "RHIZOME_PIPELINE_MICROBATCHES"
PIPELINE_METRICS_EVERY = "RHIZOME_PIPELINE_METRICS_EVERY"

RUNTIME_PREFIX = "RHIZOME_RUNTIME_"
# `RHIZOME_RUNTIME_STORE=etcd`: the rendezvous store is kept in the platform's etcd
# (learner/runtime/etcd_store.py), not in a TCPStore some process hosts.
ETCD_STORE = "etcd"

DEFAULT_CHECKPOINT_DIR = Path(".rhizome/checkpoints")
INSURANCE_MODES = ("auto", "always", "never")
CHECKPOINT_POLICIES = ("adaptive", "fixed", "none")
_LAUNCH_HINT = (
    "start this script with `python -m learner.runtime.launch --stages P --pipelines D script.py`"
)


class LearnerConfigError(ValueError):
    """A learner variable is missing or malformed; `variable` names it."""

    def __init__(self, variable: str, problem: str) -> None:
        super().__init__(f"{variable}{problem}")
        self.variable = variable


class Role(StrEnum):
    """The `RHIZOME_ROLE` label: which process of a learner this is."""

    CONTROLLER = "controller"
    LEARNER = "learner"


# -- parsing helpers: each names the variable in its error ---------------------------------
def _raw(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    return None if raw is None or raw == "" else raw


def _str(env: Mapping[str, str], name: str, default: str | None = None) -> str | None:
    raw = _raw(env, name)
    return default if raw is None else raw


def _required(env: Mapping[str, str], name: str, hint: str) -> str:
    raw = _raw(env, name)
    if raw is None:
        raise LearnerConfigError(name, f" is not set: {hint}")
    return raw


def _int_value(name: str, raw: str, minimum: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise LearnerConfigError(
            name, f"={raw!r} must be a whole number, e.g. {name}={max(minimum, 1)}"
        ) from None
    if value < minimum:
        raise LearnerConfigError(name, f"={raw!r} must be >= {minimum}")
    return value


def _int(env: Mapping[str, str], name: str, default: int, minimum: int = 0) -> int:
    raw = _raw(env, name)
    return default if raw is None else _int_value(name, raw, minimum)


def _float_value(name: str, raw: str, positive: bool) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise LearnerConfigError(
            name, f"={raw!r} is not a number of seconds; set e.g. {name}=30"
        ) from None
    if positive and not value > 0:
        raise LearnerConfigError(name, f"={raw!r} must be > 0")
    return value


def _float(env: Mapping[str, str], name: str, default: float, *, positive: bool = True) -> float:
    raw = _raw(env, name)
    return default if raw is None else _float_value(name, raw, positive)


def _fmt(value: Any) -> str:
    """How a field is written: three decimals for seconds (readable, and what the
    platform has always written) unless that would lose the value."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        short = f"{value:.3f}"
        return short if float(short) == value else repr(value)
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def learner_dir(job_dir: str | Path, rank: int) -> Path:
    """A learner's directory in its job's: its command's output, metric files, offsets."""
    return Path(job_dir) / "learners" / str(rank)


@dataclass(frozen=True)
class RuntimeEnv:
    """What the pipeline runtime's launcher tells each worker (`RHIZOME_RUNTIME_*`)."""

    worker: int
    stages: int
    pipelines: int
    store: str  # host:port of the launcher's TCPStore, or `etcd` (ETCD_STORE) on the platform
    etcd: str  # etcd client URL
    job_id: str  # keys live under etcd_keys.runtime_prefix(job_id)
    backend: str = "gloo"
    device: str | None = None  # None: cuda with nccl, cpu otherwise
    detection_timeout_s: float = 10.0
    lease_ttl_s: float = 2.0
    out_dir: str | None = None
    kill: str = ""  # testing: worker:step:op[:microbatch][,...]
    redundancy: str | None = None  # overrides the script's redundancy mode
    microbatches: int | None = None  # overrides the script's microbatches per step
    # None: not set by the launcher, so a value in the launcher's own environment (or the
    # worker's default) stands.
    threads: int | None = None
    # a replacement's admission token: it joins a running job (learner/runtime/reconfigure.py)
    join_token: str | None = None
    # block checkpoints (learner/runtime/block_checkpoint.py): where, and every how many steps
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10
    # where the worker appends its per-step metrics (contract/runtime_metrics.py); None: not
    metrics_file: str | None = None
    # one line per this many ended steps (their means; learner/runtime/step_metrics.py)
    metrics_every: int = 1

    # field -> variable suffix (the names predate this record; keep them)
    _NAMES = {
        "worker": "WORKER",
        "stages": "STAGES",
        "pipelines": "PIPELINES",
        "store": "STORE",
        "etcd": "ETCD",
        "job_id": "JOB_ID",
        "backend": "BACKEND",
        "device": "DEVICE",
        "detection_timeout_s": "DETECTION_TIMEOUT",
        "lease_ttl_s": "LEASE_TTL",
        "out_dir": "OUT_DIR",
        "kill": "KILL",
        "redundancy": "REDUNDANCY",
        "microbatches": "MICROBATCHES",
        "threads": "THREADS",
        "join_token": "JOIN_TOKEN",
        "checkpoint_dir": "CHECKPOINT_DIR",
        "checkpoint_every": "CHECKPOINT_EVERY",
        "metrics_file": "METRICS_FILE",
        "metrics_every": "METRICS_EVERY",
    }

    @classmethod
    def var(cls, field_name: str) -> str:
        return RUNTIME_PREFIX + cls._NAMES[field_name]

    @property
    def resolved_device(self) -> str:
        return self.device or ("cuda" if self.backend == "nccl" else "cpu")

    @property
    def resolved_threads(self) -> int:
        """torch's intra-op threads: one unless told (P x D workers share the cores)."""
        return self.threads or 1

    def to_environ(self) -> dict[str, str]:
        return {
            self.var(f.name): _fmt(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }

    @classmethod
    def for_learner(cls, env: LearnerEnv, etcd: str) -> RuntimeEnv | None:
        """What the learner controller of a pipeline job gives its command: one worker,
        worker = rank, the shape from the manifest's `pipeline:` section, the job's own
        keys (`etcd_keys.runtime_prefix(job_id)`) on the platform's etcd, the rendezvous
        store in that etcd, and each worker's parameters saved to the learner's result
        directory. None for a job without a `pipeline:` section."""
        if env.pipeline_stages is None:
            return None
        if env.rank is None or env.job_id is None:
            missing = RANK if env.rank is None else JOB_ID
            raise LearnerConfigError(missing, " is not set: a pipeline learner needs it")
        return cls(
            worker=env.rank,
            stages=env.pipeline_stages,
            pipelines=env.pipeline_pipelines or 1,
            store=ETCD_STORE,
            etcd=etcd,
            job_id=env.job_id,
            out_dir=env.result_dir,
            redundancy=env.pipeline_redundancy,
            microbatches=env.pipeline_microbatches,
            join_token=env.join_token,
            # a job restarted after a fatal loss starts from these (the job's checkpoints)
            checkpoint_dir=None
            if env.checkpoint_dir is None
            else str(Path(env.checkpoint_dir) / "pipeline"),
            # read by the job's `runtime_metrics.SOURCE` (the learner's collector)
            metrics_file=None
            if env.job_dir is None
            else str(learner_dir(env.job_dir, env.rank) / runtime_metrics.FILE),
            metrics_every=env.pipeline_metrics_every or 1,
        )

    @classmethod
    def present(cls, environ: Mapping[str, str]) -> bool:
        return any(k.startswith(RUNTIME_PREFIX) for k in environ)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> RuntimeEnv:
        v = cls.var
        store = _required(environ, v("store"), _LAUNCH_HINT)
        host, _, port = store.rpartition(":")
        if store != ETCD_STORE and (not host or not port.isdigit()):
            raise LearnerConfigError(v("store"), f"={store!r} must be HOST:PORT or {ETCD_STORE}")
        return cls(
            worker=_int_value(v("worker"), _required(environ, v("worker"), _LAUNCH_HINT), 0),
            stages=_int_value(v("stages"), _required(environ, v("stages"), _LAUNCH_HINT), 1),
            pipelines=_int_value(
                v("pipelines"), _required(environ, v("pipelines"), _LAUNCH_HINT), 1
            ),
            store=store,
            etcd=_required(environ, v("etcd"), _LAUNCH_HINT),
            job_id=_required(environ, v("job_id"), _LAUNCH_HINT),
            backend=_str(environ, v("backend"), "gloo") or "gloo",
            device=_str(environ, v("device")),
            detection_timeout_s=_float(environ, v("detection_timeout_s"), 10.0),
            lease_ttl_s=_float(environ, v("lease_ttl_s"), 2.0),
            out_dir=_str(environ, v("out_dir")),
            kill=_str(environ, v("kill"), "") or "",
            redundancy=_str(environ, v("redundancy")),
            microbatches=None
            if _raw(environ, v("microbatches")) is None
            else _int(environ, v("microbatches"), 1, minimum=1),
            threads=None
            if _raw(environ, v("threads")) is None
            else _int(environ, v("threads"), 1, minimum=1),
            join_token=_str(environ, v("join_token")),
            checkpoint_dir=_str(environ, v("checkpoint_dir")),
            checkpoint_every=_int(environ, v("checkpoint_every"), 10, minimum=0),
            metrics_file=_str(environ, v("metrics_file")),
            metrics_every=_int(environ, v("metrics_every"), 1, minimum=1),
        )


# field -> variable, for every LearnerEnv field but `runtime`
_LEARNER_VARS = {
    "job_id": JOB_ID,
    "rank": RANK,
    "role": ROLE,
    "learner_id": LEARNER_ID,
    "job_dir": JOB_DIR,
    "checkpoint_dir": CHECKPOINT_DIR,
    "result_dir": RESULT_DIR,
    "secrets": SECRETS,
    "mttp_s": MTTP_S,
    "restart_s": RESTART_S,
    "join_token": JOIN_TOKEN,
    "elastic_etcd": ELASTIC_ETCD,
    "grace_s": GRACE_S,
    "backup_url": BACKUP_URL,
    "s3_endpoint_url": S3_ENDPOINT_URL,
    "notice_sources": NOTICE_SOURCES,
    "metadata_url": METADATA_URL,
    "notice_poll_s": NOTICE_POLL_S,
    "save_s": SAVE_S,
    "backup_s": BACKUP_S,
    "insurance": INSURANCE,
    "periodic_every_s": PERIODIC_EVERY_S,
    "keep": KEEP,
    "emergency_exit": EMERGENCY_EXIT,
    "checkpoint_policy": CHECKPOINT_POLICY,
    "checkpoint_interval_s": CHECKPOINT_INTERVAL_S,
    "pipeline_stages": PIPELINE_STAGES,
    "pipeline_pipelines": PIPELINE_PIPELINES,
    "pipeline_redundancy": PIPELINE_REDUNDANCY,
    "pipeline_microbatches": PIPELINE_MICROBATCHES,
    "pipeline_metrics_every": PIPELINE_METRICS_EVERY,
}


@dataclass(frozen=True)
class LearnerEnv:
    """Every variable a learner process receives; see the module docstring's tables."""

    # written by the platform
    job_id: str | None = None
    rank: int | None = None
    role: Role | None = None
    learner_id: str = "0"
    job_dir: str | None = None
    checkpoint_dir: str | None = None
    result_dir: str | None = None
    secrets: str | None = None
    mttp_s: float = 3600.0
    restart_s: float = 300.0
    join_token: str | None = None
    # an elastic job's coordination etcd (the platform's, as reachable from the learner)
    elastic_etcd: str | None = None
    # checkpointing knobs
    grace_s: float = 30.0
    backup_url: str | None = None
    s3_endpoint_url: str | None = None
    notice_sources: tuple[str, ...] = ("sigterm",)
    metadata_url: str = "http://169.254.169.254"
    notice_poll_s: float = 1.0
    save_s: float = 10.0
    backup_s: float = 10.0
    insurance: str = "auto"
    periodic_every_s: float | None = None
    keep: int = 1
    emergency_exit: bool = True
    # from the manifest's checkpoint: section
    checkpoint_policy: str = "adaptive"
    checkpoint_interval_s: float | None = None
    # from the manifest's pipeline: section (what the runtime's launcher runs)
    pipeline_stages: int | None = None
    pipeline_pipelines: int | None = None
    pipeline_redundancy: str | None = None
    pipeline_microbatches: int | None = None
    pipeline_metrics_every: int | None = None
    # written by the pipeline runtime's launcher, for its workers only
    runtime: RuntimeEnv | None = field(default=None)

    # -- what the learner derives ---------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """On the platform (or told where to checkpoint): the checkpoint SDK is live."""
        return bool(self.job_id or self.checkpoint_dir)

    @property
    def checkpoint_job(self) -> str:
        """The job's name in the checkpoint store (`local` for a script run by hand)."""
        return self.job_id or "local"

    @property
    def checkpoint_root(self) -> Path:
        return Path(self.checkpoint_dir) if self.checkpoint_dir else DEFAULT_CHECKPOINT_DIR

    @staticmethod
    def var(field_name: str) -> str:
        """The variable of a field (`LearnerEnv.var("mttp_s") == "RHIZOME_MTTP_S"`)."""
        return _LEARNER_VARS[field_name]

    # -- the two directions -----------------------------------------------------------------
    def to_environ(self) -> dict[str, str]:
        """What a backend writes: every field that has a value (defaults included, so a
        learner's environment shows every setting it runs with)."""
        out = {
            var: _fmt(getattr(self, name))
            for name, var in _LEARNER_VARS.items()
            if getattr(self, name) is not None
        }
        if self.runtime is not None:
            out.update(self.runtime.to_environ())
        return out

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LearnerEnv:
        """What a learner reads (default `os.environ`); raises `LearnerConfigError`."""
        env = os.environ if environ is None else environ
        insurance = _str(env, INSURANCE, "auto") or "auto"
        if insurance not in INSURANCE_MODES:
            raise LearnerConfigError(
                INSURANCE, f"={insurance!r}: expected one of {', '.join(INSURANCE_MODES)}"
            )
        role_raw = _raw(env, ROLE)
        try:
            role = Role(role_raw) if role_raw is not None else None
        except ValueError:
            roles = ", ".join(r.value for r in Role)
            raise LearnerConfigError(ROLE, f"={role_raw!r}: expected one of {roles}") from None
        rank_raw = _raw(env, RANK)
        sources = tuple(
            s.strip() for s in (env.get(NOTICE_SOURCES) or "sigterm").split(",") if s.strip()
        )
        periodic = _raw(env, PERIODIC_EVERY_S)
        policy = _str(env, CHECKPOINT_POLICY, "adaptive") or "adaptive"
        if policy not in CHECKPOINT_POLICIES:
            raise LearnerConfigError(
                CHECKPOINT_POLICY, f"={policy!r}: expected one of {', '.join(CHECKPOINT_POLICIES)}"
            )
        interval = _raw(env, CHECKPOINT_INTERVAL_S)
        if policy == "fixed" and interval is None:
            raise LearnerConfigError(
                CHECKPOINT_INTERVAL_S, " is not set: the fixed policy needs an interval"
            )
        optional_int = {
            name: None if _raw(env, name) is None else _int(env, name, 1, minimum=1)
            for name in (
                PIPELINE_STAGES,
                PIPELINE_PIPELINES,
                PIPELINE_MICROBATCHES,
                PIPELINE_METRICS_EVERY,
            )
        }
        return cls(
            job_id=_str(env, JOB_ID),
            rank=None if rank_raw is None else _int_value(RANK, rank_raw, 0),
            role=role,
            learner_id=_str(env, LEARNER_ID, "0") or "0",
            job_dir=_str(env, JOB_DIR),
            checkpoint_dir=_str(env, CHECKPOINT_DIR),
            result_dir=_str(env, RESULT_DIR),
            secrets=_str(env, SECRETS),
            mttp_s=_float(env, MTTP_S, 3600.0),
            restart_s=_float(env, RESTART_S, 300.0, positive=False),
            join_token=_str(env, JOIN_TOKEN),
            elastic_etcd=_str(env, ELASTIC_ETCD),
            grace_s=_float(env, GRACE_S, 30.0, positive=False),
            backup_url=_str(env, BACKUP_URL),
            s3_endpoint_url=_str(env, S3_ENDPOINT_URL),
            notice_sources=sources,
            metadata_url=(_str(env, METADATA_URL) or "http://169.254.169.254").rstrip("/"),
            notice_poll_s=_float(env, NOTICE_POLL_S, 1.0),
            save_s=_float(env, SAVE_S, 10.0, positive=False),
            backup_s=_float(env, BACKUP_S, 10.0, positive=False),
            insurance=insurance,
            periodic_every_s=None
            if periodic is None
            else _float_value(PERIODIC_EVERY_S, periodic, True),
            keep=_int(env, KEEP, 1),
            emergency_exit=(env.get(EMERGENCY_EXIT) or "1") not in ("0", "false", "no"),
            checkpoint_policy=policy,
            checkpoint_interval_s=None
            if interval is None
            else _float_value(CHECKPOINT_INTERVAL_S, interval, True),
            pipeline_stages=optional_int[PIPELINE_STAGES],
            pipeline_pipelines=optional_int[PIPELINE_PIPELINES],
            pipeline_redundancy=_str(env, PIPELINE_REDUNDANCY),
            pipeline_microbatches=optional_int[PIPELINE_MICROBATCHES],
            pipeline_metrics_every=optional_int[PIPELINE_METRICS_EVERY],
            runtime=RuntimeEnv.from_environ(env) if RuntimeEnv.present(env) else None,
        )


def elastic_worker_name(rank: int) -> str:
    """An elastic job's worker name on the platform: its learner's rank and a random part
    (a rank added again after it left is a new worker). The guardian finds a scale-out's
    learners among the members of the workers' state by it (`elastic_worker_rank`)."""
    return f"learner{rank}-{os.urandom(3).hex()}"


def elastic_worker_rank(name: str) -> int | None:
    head, sep, _ = name.partition("-")
    rank = head.removeprefix("learner")
    return int(rank) if sep and head.startswith("learner") and rank.isdigit() else None


def labels(job_id: str, rank: int, role: Role) -> dict[str, str]:
    """The three variables by which `contract.procs.labelled` finds a job's processes
    (a pid alone is not an identity; these survive their parent's death)."""
    return {JOB_ID: job_id, RANK: str(rank), ROLE: role.value}


def platform_variables(environ: Mapping[str, str]) -> list[str]:
    """The `RHIZOME_*` names in `environ` (a backend drops its own before starting a
    learner: the platform's settings are not the learner's business)."""
    return [k for k in environ if k.startswith(PREFIX)]
