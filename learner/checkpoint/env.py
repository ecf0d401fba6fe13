"""Every environment variable the checkpointing layer reads, in one place.

The platform (the guardian, from `services/store/preemption_stats.py`) sets these when it
deploys a learner; a learner never talks to MongoDB itself (`learner/` never imports
`services/`). A script started by hand sets none of them and gets the dummy twin of the
SDK, so the same script runs bare.

| variable | meaning | default |
| --- | --- | --- |
| `RHIZOME_JOB_ID` | job id; its presence (or `RHIZOME_CHECKPOINT_DIR`) turns the SDK on | unset |
| `RHIZOME_CHECKPOINT_DIR` | object store root (a local directory) | `./.rhizome/checkpoints` |
| `RHIZOME_BACKUP_URL` | back up to this store instead: `s3://bucket/prefix` (endpoint `RHIZOME_S3_ENDPOINT_URL`) or a path | unset (the checkpoint dir) |
| `RHIZOME_LEARNER_ID` | this learner's id, namespaced in the store | `0` |
| `RHIZOME_MTTP_S` | platform's mean time to preemption for this job's instance type+zone | `3600` |
| `RHIZOME_RESTART_S` | platform's mean restart time R (allocation + preparation) | `300` |
| `RHIZOME_GRACE_S` | grace period after SIGTERM before SIGKILL | `30` |
| `RHIZOME_NOTICE_SOURCES` | comma-separated notice sources: `sigterm,aws,azure,gcp` | `sigterm` |
| `RHIZOME_METADATA_URL` | base URL of the cloud metadata service (tests use 127.0.0.1) | `http://169.254.169.254` |
| `RHIZOME_NOTICE_POLL_S` | metadata polling period | `1` |
| `RHIZOME_SAVE_S` | prior for the save time δ until one is measured | `10` |
| `RHIZOME_BACKUP_S` | prior for the backup time β until one is measured | `10` |
| `RHIZOME_INSURANCE` | `auto` (insurance only when an emergency save would not fit), `always`, `never` | `auto` |
| `RHIZOME_PERIODIC_EVERY_S` | the script's own save period, if it declares one | unset (learned) |
| `RHIZOME_KEEP` | committed periodic checkpoints kept besides the newest | `1` |
| `RHIZOME_EMERGENCY_EXIT` | exit after an emergency save is committed (`1`) or keep going (`0`) | `1` |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

JOB_ID = "RHIZOME_JOB_ID"
CHECKPOINT_DIR = "RHIZOME_CHECKPOINT_DIR"
BACKUP_URL = "RHIZOME_BACKUP_URL"
LEARNER_ID = "RHIZOME_LEARNER_ID"
MTTP_S = "RHIZOME_MTTP_S"
RESTART_S = "RHIZOME_RESTART_S"
GRACE_S = "RHIZOME_GRACE_S"
NOTICE_SOURCES = "RHIZOME_NOTICE_SOURCES"
METADATA_URL = "RHIZOME_METADATA_URL"
NOTICE_POLL_S = "RHIZOME_NOTICE_POLL_S"
SAVE_S = "RHIZOME_SAVE_S"
BACKUP_S = "RHIZOME_BACKUP_S"
INSURANCE = "RHIZOME_INSURANCE"
PERIODIC_EVERY_S = "RHIZOME_PERIODIC_EVERY_S"
KEEP = "RHIZOME_KEEP"
EMERGENCY_EXIT = "RHIZOME_EMERGENCY_EXIT"

ALL = (
    JOB_ID,
    CHECKPOINT_DIR,
    LEARNER_ID,
    MTTP_S,
    RESTART_S,
    GRACE_S,
    NOTICE_SOURCES,
    METADATA_URL,
    NOTICE_POLL_S,
    SAVE_S,
    BACKUP_S,
    INSURANCE,
    PERIODIC_EVERY_S,
    KEEP,
    EMERGENCY_EXIT,
)

# 128 + SIGTERM: what a supervisor already reads as "terminated on request", so a learner
# that saved and left on a notice is never mistaken for one that finished training.
PREEMPTED_EXIT_CODE = 143

INSURANCE_MODES = ("auto", "always", "never")


class EnvError(ValueError):
    """An environment variable has a value the checkpointing layer cannot use."""


def _float(env: Mapping[str, str], name: str, default: float, *, positive: bool = True) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not a number of seconds; set e.g. {name}=30") from None
    if positive and not value > 0:
        raise EnvError(f"{name}={raw!r} must be > 0")
    return value


@dataclass(frozen=True)
class CheckpointEnv:
    """The parsed configuration; `from_env()` reads `os.environ` (or any mapping)."""

    enabled: bool = False
    job_id: str = "local"
    checkpoint_dir: Path = Path(".rhizome/checkpoints")
    backup_url: str = ""
    learner_id: str = "0"
    mttp_s: float = 3600.0
    restart_s: float = 300.0
    grace_s: float = 30.0
    notice_sources: tuple[str, ...] = ("sigterm",)
    metadata_url: str = "http://169.254.169.254"
    notice_poll_s: float = 1.0
    save_s: float = 10.0
    backup_s: float = 10.0
    insurance: str = "auto"
    periodic_every_s: float | None = None
    keep: int = 1
    emergency_exit: bool = True
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CheckpointEnv:
        env = os.environ if env is None else env
        insurance = env.get(INSURANCE, "auto") or "auto"
        if insurance not in INSURANCE_MODES:
            raise EnvError(
                f"{INSURANCE}={insurance!r}: expected one of {', '.join(INSURANCE_MODES)}"
            )
        sources = tuple(
            s.strip() for s in (env.get(NOTICE_SOURCES) or "sigterm").split(",") if s.strip()
        )
        keep_raw = env.get(KEEP) or "1"
        try:
            keep = int(keep_raw)
        except ValueError:
            raise EnvError(f"{KEEP}={keep_raw!r} must be a whole number, e.g. {KEEP}=1") from None
        if keep < 0:
            raise EnvError(f"{KEEP}={keep_raw!r} must be >= 0")
        periodic = env.get(PERIODIC_EVERY_S)
        return cls(
            enabled=bool(env.get(JOB_ID) or env.get(CHECKPOINT_DIR)),
            job_id=env.get(JOB_ID) or "local",
            checkpoint_dir=Path(env.get(CHECKPOINT_DIR) or ".rhizome/checkpoints"),
            backup_url=env.get(BACKUP_URL) or "",
            learner_id=env.get(LEARNER_ID) or "0",
            mttp_s=_float(env, MTTP_S, 3600.0),
            restart_s=_float(env, RESTART_S, 300.0, positive=False),
            grace_s=_float(env, GRACE_S, 30.0, positive=False),
            notice_sources=sources,
            metadata_url=(env.get(METADATA_URL) or "http://169.254.169.254").rstrip("/"),
            notice_poll_s=_float(env, NOTICE_POLL_S, 1.0),
            save_s=_float(env, SAVE_S, 10.0, positive=False),
            backup_s=_float(env, BACKUP_S, 10.0, positive=False),
            insurance=insurance,
            periodic_every_s=_float(env, PERIODIC_EVERY_S, 0.0) if periodic else None,
            keep=keep,
            emergency_exit=(env.get(EMERGENCY_EXIT) or "1") not in ("0", "false", "no"),
        )
