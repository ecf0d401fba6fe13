"""The `preemption_stats` repository: what the platform has seen of spot preemptions and
reallocations, and the MTTP / restart-time estimates the checkpoint policy reads.

Records, one document each (`kind` says which):
- `preemption`: a node of `instance_type` in `zone` was preempted after `lifetime_s`.
- `survival`: a node was released without being preempted after `lifetime_s` — a
  censored lifetime, which an MTTP estimate must count or it would be biased low.
- `reallocation`: a replacement node took `wait_s` to get and `prepare_s` to prepare.

Estimates, per (instance type, zone), from the most recent `window` records of each kind:
- MTTP = (Σ lifetimes of preempted nodes + Σ lifetimes of survivors) / #preemptions,
  the maximum-likelihood mean of an exponential lifetime with right-censoring.
- R = mean of `wait_s + prepare_s` over reallocations.
Each falls back from the zone to the instance type (all zones) to the configured prior
when fewer than `min_samples` records back it; `Estimate.scope` says which was used.

The guardian turns an estimate into the learner's environment with `learner_env()`
(`RHIZOME_MTTP_S`, `RHIZOME_RESTART_S`, see `contract/env.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pymongo
from pymongo.database import Database

from contract import env as learner_vars
from services.store.retry import with_retries

COLLECTION = "preemption_stats"
KINDS = ("preemption", "survival", "reallocation")


@dataclass(frozen=True)
class Estimate:
    instance_type: str
    zone: str
    mttp_s: float
    restart_s: float
    preemptions: int
    reallocations: int
    mttp_scope: str  # "zone", "instance_type" or "prior"
    restart_scope: str

    def learner_env(self) -> dict[str, str]:
        """The variables the guardian sets on the job's learners."""
        return {
            learner_vars.MTTP_S: f"{self.mttp_s:.3f}",
            learner_vars.RESTART_S: f"{self.restart_s:.3f}",
        }


def _check_name(what: str, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string such as 'p3.2xlarge' / 'us-east-1a'")


def _check_seconds(what: str, value: float) -> None:
    if not value >= 0:
        raise ValueError(f"{what} must be >= 0 seconds, got {value!r}")


class PreemptionStatsRepository:
    """Preemption and reallocation records in MongoDB; every query uses an index from
    `ensure_indexes`."""

    def __init__(
        self,
        db: Database[Any],
        *,
        prior_mttp_s: float = 3600.0,
        prior_restart_s: float = 300.0,
        window: int = 1000,
        min_samples: int = 3,
    ) -> None:
        if prior_mttp_s <= 0 or prior_restart_s < 0:
            raise ValueError("prior_mttp_s must be > 0 and prior_restart_s >= 0")
        if window < 1 or min_samples < 1:
            raise ValueError("window and min_samples must be >= 1")
        self._col = db[COLLECTION]
        self.prior_mttp_s = prior_mttp_s
        self.prior_restart_s = prior_restart_s
        self.window = window
        self.min_samples = min_samples

    @with_retries
    def ensure_indexes(self) -> None:
        # per zone, newest first
        self._col.create_index(
            [
                ("instance_type", pymongo.ASCENDING),
                ("zone", pymongo.ASCENDING),
                ("kind", pymongo.ASCENDING),
                ("at", pymongo.DESCENDING),
            ]
        )
        # per instance type across zones, newest first
        self._col.create_index(
            [
                ("instance_type", pymongo.ASCENDING),
                ("kind", pymongo.ASCENDING),
                ("at", pymongo.DESCENDING),
            ]
        )

    # -- records ------------------------------------------------------------------
    def _insert(self, doc: dict[str, Any]) -> None:
        _check_name("instance_type", doc["instance_type"])
        _check_name("zone", doc["zone"])
        doc.setdefault("at", time.time())
        # Not retried: a retry after a lost acknowledgement could count one event twice.
        self._col.insert_one(doc)

    def record_preemption(
        self,
        instance_type: str,
        zone: str,
        lifetime_s: float,
        *,
        job_id: str = "",
        node: str = "",
        at: float | None = None,
    ) -> None:
        """A node was preempted after `lifetime_s`."""
        self._record_lifetime("preemption", instance_type, zone, lifetime_s, job_id, node, at)

    def record_survival(
        self,
        instance_type: str,
        zone: str,
        lifetime_s: float,
        *,
        job_id: str = "",
        node: str = "",
        at: float | None = None,
    ) -> None:
        """A node was released unpreempted after `lifetime_s` (a censored lifetime)."""
        self._record_lifetime("survival", instance_type, zone, lifetime_s, job_id, node, at)

    def _record_lifetime(
        self,
        kind: str,
        instance_type: str,
        zone: str,
        lifetime_s: float,
        job_id: str,
        node: str,
        at: float | None,
    ) -> None:
        _check_seconds("lifetime_s", lifetime_s)
        doc: dict[str, Any] = {
            "kind": kind,
            "instance_type": instance_type,
            "zone": zone,
            "lifetime_s": float(lifetime_s),
            "job_id": job_id,
            "node": node,
        }
        if at is not None:
            doc["at"] = at
        self._insert(doc)

    def record_reallocation(
        self,
        instance_type: str,
        zone: str,
        wait_s: float,
        *,
        prepare_s: float = 0.0,
        job_id: str = "",
        at: float | None = None,
    ) -> None:
        _check_seconds("wait_s", wait_s)
        _check_seconds("prepare_s", prepare_s)
        doc = {
            "kind": "reallocation",
            "instance_type": instance_type,
            "zone": zone,
            "wait_s": float(wait_s),
            "prepare_s": float(prepare_s),
            "job_id": job_id,
        }
        if at is not None:
            doc["at"] = at
        self._insert(doc)

    # -- estimates ----------------------------------------------------------------
    @with_retries
    def _recent(self, instance_type: str, zone: str | None, kind: str) -> list[dict[str, Any]]:
        query: dict[str, Any] = {"instance_type": instance_type, "kind": kind}
        if zone is not None:
            query["zone"] = zone
        cursor = (
            self._col.find(query, {"_id": 0, "lifetime_s": 1, "wait_s": 1, "prepare_s": 1})
            .sort("at", pymongo.DESCENDING)
            .limit(self.window)
        )
        return list(cursor)

    def _mttp(self, instance_type: str, zone: str | None) -> tuple[float, int] | None:
        preempted = self._recent(instance_type, zone, "preemption")
        if len(preempted) < self.min_samples:
            return None
        survived = self._recent(instance_type, zone, "survival")
        exposure = sum(float(d["lifetime_s"]) for d in preempted + survived)
        return max(exposure / len(preempted), 1e-3), len(preempted)

    def _restart(self, instance_type: str, zone: str | None) -> tuple[float, int] | None:
        reallocs = self._recent(instance_type, zone, "reallocation")
        if len(reallocs) < self.min_samples:
            return None
        total = sum(float(d["wait_s"]) + float(d.get("prepare_s") or 0.0) for d in reallocs)
        return total / len(reallocs), len(reallocs)

    def estimate(self, instance_type: str, zone: str) -> Estimate:
        """The current MTTP and restart-time estimates for a job's instance type and zone."""
        _check_name("instance_type", instance_type)
        _check_name("zone", zone)
        mttp, mttp_scope, n_pre = self.prior_mttp_s, "prior", 0
        for scope, z in (("zone", zone), ("instance_type", None)):
            got = self._mttp(instance_type, z)
            if got is not None:
                (mttp, n_pre), mttp_scope = got, scope
                break
        restart, restart_scope, n_re = self.prior_restart_s, "prior", 0
        for scope, z in (("zone", zone), ("instance_type", None)):
            got = self._restart(instance_type, z)
            if got is not None:
                (restart, n_re), restart_scope = got, scope
                break
        return Estimate(instance_type, zone, mttp, restart, n_pre, n_re, mttp_scope, restart_scope)
