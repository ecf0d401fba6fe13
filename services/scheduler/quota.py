"""Per-user, per-GPU-type quotas and limits, with borrowing of idle quota (FfDL §3.6).

Config (YAML or a mapping; every key checked, GPU types checked against the cluster)::

    borrowing: true            # may a user run beyond its quota on idle GPUs? (default true)
    default:                   # users without an entry of their own
      quota: {}                # guaranteed GPUs per type (missing type: 0)
      limit: {}                # hard cap per type, borrowed GPUs included (missing: none)
    users:
      alice:
        quota: {V100: 8}
        limit: {V100: 16, K80: 4}

A job whose owner stays within its quota is *guaranteed*. A job beyond the quota
*borrows* idle GPUs: it runs if they are free, and it is preempted (halted and
queued again, not lost) when a guaranteed job cannot be placed otherwise. A job that
would take its owner beyond the limit waits; one larger than the limit is refused.
Without any quota config every job is guaranteed and nothing is preempted.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from services.scheduler.api import JobRequest, QuotaConfigError


class QuotaClass(enum.StrEnum):
    GUARANTEED = "guaranteed"
    BORROW = "borrow"
    OVER_QUOTA = "over-quota"  # beyond quota and borrowing is off
    OVER_LIMIT = "over-limit"  # would exceed the hard limit


@dataclass(frozen=True)
class UserQuota:
    quota: Mapping[str, int] = field(default_factory=dict)
    limit: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class QuotaConfig:
    users: Mapping[str, UserQuota] = field(default_factory=dict)
    default: UserQuota = field(default_factory=UserQuota)
    borrowing: bool = True

    def entry(self, user: str) -> UserQuota:
        return self.users.get(user, self.default)

    def quota(self, user: str, gpu_type: str) -> int:
        return int(self.entry(user).quota.get(gpu_type, 0))

    def limit(self, user: str, gpu_type: str) -> int | None:
        value = self.entry(user).limit.get(gpu_type)
        return None if value is None else int(value)


def _hint(key: str, allowed: Iterable[str]) -> str:
    match = difflib.get_close_matches(key, list(allowed), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _per_type(where: str, raw: Any, gpu_types: list[str] | None) -> dict[str, int]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise QuotaConfigError(f"{where}: expected a mapping of GPU type to a number of GPUs")
    out: dict[str, int] = {}
    for gpu_type, value in raw.items():
        gpu_type = str(gpu_type)
        if gpu_types is not None and gpu_type not in gpu_types:
            known = ", ".join(gpu_types) or "none"
            raise QuotaConfigError(
                f"{where}: unknown GPU type {gpu_type!r}{_hint(gpu_type, gpu_types)}; "
                f"the cluster has {known}"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise QuotaConfigError(
                f"{where}.{gpu_type}: {value!r}; use a whole number of GPUs >= 0"
            )
        out[gpu_type] = value
    return out


def _user(where: str, raw: Any, gpu_types: list[str] | None) -> UserQuota:
    if raw is None:
        return UserQuota()
    if not isinstance(raw, Mapping):
        raise QuotaConfigError(f"{where}: expected a mapping with 'quota' and/or 'limit'")
    for key in raw:
        if key not in ("quota", "limit"):
            raise QuotaConfigError(
                f"{where}: unknown key {key!r}{_hint(str(key), ['quota', 'limit'])}"
            )
    quota = _per_type(f"{where}.quota", raw.get("quota"), gpu_types)
    limit = _per_type(f"{where}.limit", raw.get("limit"), gpu_types)
    for gpu_type, q in quota.items():
        if gpu_type in limit and limit[gpu_type] < q:
            raise QuotaConfigError(
                f"{where}: limit {limit[gpu_type]} {gpu_type} is below the quota {q}; "
                "a limit caps borrowed GPUs too, so it must be >= the quota"
            )
    return UserQuota(quota=quota, limit=limit)


def quota_config_from_mapping(
    raw: Mapping[str, Any], gpu_types: list[str] | None = None, source: str = "quota config"
) -> QuotaConfig:
    """Parse and check a quota config; ``gpu_types`` (the cluster's) rejects unknown types."""
    if not isinstance(raw, Mapping):
        raise QuotaConfigError(f"{source}: expected a mapping with 'users', 'default', 'borrowing'")
    allowed = ("users", "default", "borrowing")
    for key in raw:
        if key not in allowed:
            raise QuotaConfigError(f"{source}: unknown key {key!r}{_hint(str(key), allowed)}")
    borrowing = raw.get("borrowing", True)
    if not isinstance(borrowing, bool):
        raise QuotaConfigError(f"{source}: borrowing={borrowing!r}; use true or false")
    users_raw = raw.get("users") or {}
    if not isinstance(users_raw, Mapping):
        raise QuotaConfigError(f"{source}: 'users' must map user names to their quota")
    users = {str(u): _user(f"{source}: users.{u}", v, gpu_types) for u, v in users_raw.items()}
    default = _user(f"{source}: default", raw.get("default"), gpu_types)
    return QuotaConfig(users=users, default=default, borrowing=borrowing)


def load_quota_config(path: str | Path, gpu_types: list[str] | None = None) -> QuotaConfig:
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise QuotaConfigError(f"cannot read quota config {p}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise QuotaConfigError(f"{p}: not valid YAML: {exc}") from exc
    return quota_config_from_mapping(raw or {}, gpu_types, str(p))


class QuotaLedger:
    """GPUs in use per (user, type), split into guaranteed and borrowed."""

    def __init__(self, config: QuotaConfig | None) -> None:
        self.config = config
        self.guaranteed: dict[tuple[str, str], int] = {}
        self.borrowed: dict[tuple[str, str], int] = {}
        self.changes = 0  # charges and refunds so far (GangScheduler._fingerprint)

    def used(self, user: str, gpu_type: str) -> int:
        key = (user, gpu_type)
        return self.guaranteed.get(key, 0) + self.borrowed.get(key, 0)

    def classify(self, job: JobRequest) -> QuotaClass:
        if self.config is None or job.gpus == 0:
            return QuotaClass.GUARANTEED
        need = job.total_gpus
        limit = self.config.limit(job.owner, job.gpu_type)
        if limit is not None and self.used(job.owner, job.gpu_type) + need > limit:
            return QuotaClass.OVER_LIMIT
        quota = self.config.quota(job.owner, job.gpu_type)
        if self.guaranteed.get((job.owner, job.gpu_type), 0) + need <= quota:
            return QuotaClass.GUARANTEED
        return QuotaClass.BORROW if self.config.borrowing else QuotaClass.OVER_QUOTA

    def never_fits(self, job: JobRequest) -> str:
        """A reason when the job exceeds its owner's hard limit on its own, else ''."""
        if self.config is None or job.gpus == 0:
            return ""
        limit = self.config.limit(job.owner, job.gpu_type)
        if limit is not None and job.total_gpus > limit:
            return (
                f"it needs {job.total_gpus} {job.gpu_type} but the limit of "
                f"{job.owner or 'this user'} is {limit} {job.gpu_type}"
            )
        if not self.config.borrowing and job.total_gpus > self.config.quota(
            job.owner, job.gpu_type
        ):
            return (
                f"it needs {job.total_gpus} {job.gpu_type}, the quota of "
                f"{job.owner or 'this user'} is {self.config.quota(job.owner, job.gpu_type)} "
                "and borrowing is off"
            )
        return ""

    def charge(self, job: JobRequest, borrowing: bool) -> None:
        if job.gpus == 0:
            return
        book = self.borrowed if borrowing else self.guaranteed
        key = (job.owner, job.gpu_type)
        book[key] = book.get(key, 0) + job.total_gpus
        self.changes += 1

    def refund(self, job: JobRequest, borrowing: bool) -> None:
        if job.gpus == 0:
            return
        book = self.borrowed if borrowing else self.guaranteed
        key = (job.owner, job.gpu_type)
        book[key] = max(0, book.get(key, 0) - job.total_gpus)
        self.changes += 1
