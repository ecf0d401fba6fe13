"""A guardian's settings: what the LCM passes it (`GuardianConfig`), the platform's
`RHIZOME_*` knobs it reads from the environment, and the learners' lease TTL, which the
LCM checks at the daemon's start with the same function."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.learner_spec import DEFAULT_LEARNER_LEASE_TTL_S

# The platform's knob for its learners' lease TTL (contract/learner_spec.py says what the
# lease does). Longer than a guardian's own 2 s lease: a learner's keep-alives are paid by
# etcd (a refresh every TTL/4 from each learner: 20,000 a second from 10,000 learners at
# 2 s, 4,000 at 10 s) and by its own process, and a lease that lapses because the
# controller or etcd was busy for a moment makes its guardian start a successor for a
# learner that runs (the controllers' fence keeps one of them acting, docs/lifecycle.md). What the TTL delays is noticing a controller that disappeared
# without its guardian seeing the process go: its machine lost, or (guardian hosts on the
# docker and Kubernetes backends) a container killed outright; a controller its guardian
# started on the local backend is its child, whose exit it sees at once. 2 s is etcd's
# shortest lease; 60 s bounds how long a lost machine's learners are waited for.
LEARNER_LEASE_TTL_ENV = "RHIZOME_LEARNER_LEASE_TTL_S"
LEARNER_LEASE_TTL_RANGE_S = (2, 60)


def learner_lease_ttl_from_env(environ: Mapping[str, str] = os.environ) -> int:
    """`$RHIZOME_LEARNER_LEASE_TTL_S` (unset or empty: the default), a whole number of
    seconds within LEARNER_LEASE_TTL_RANGE_S; anything else is a ValueError naming the
    variable (the LCM checks it at the daemon's start, a guardian at its own)."""
    raw = environ.get(LEARNER_LEASE_TTL_ENV, "").strip()
    if not raw:
        return DEFAULT_LEARNER_LEASE_TTL_S
    low, high = LEARNER_LEASE_TTL_RANGE_S
    try:
        ttl = int(raw)
    except ValueError:
        ttl = low - 1
    if not low <= ttl <= high:
        raise ValueError(
            f"${LEARNER_LEASE_TTL_ENV} is {raw!r}: the learners' etcd lease TTL is a whole "
            f"number of seconds from {low} to {high} (default {DEFAULT_LEARNER_LEASE_TTL_S})"
        )
    return ttl


@dataclass
class GuardianConfig:
    job_id: str
    etcd_url: str
    mongodb_uri: str
    data_dir: Path
    backend: str = "local"
    tds_address: str = ""
    tds_token: str = field(default="", repr=False)  # the job token (services/security)
    tds_tls: dict[str, str] = field(default_factory=dict, repr=False)  # the job's client cert
    # The job's own etcd user (`USER:PASSWORD`) from the LCM, for the learners; empty where
    # etcd has no authentication.
    etcd_credentials: str = field(default="", repr=False)
    # The internal port's CA directory: the guardian re-issues the job's short-lived TDS
    # certificate from it (`renew_job_certificate`). Empty: no renewal (plaintext).
    tds_tls_dir: str = ""
    # The scheduler's internal port and the service credential for it: where a lost
    # pipeline learner's replacement goes (ReplaceLearner; services/guardian/replacement.py).
    # Empty: the platform places jobs itself, a replacement reuses the lost node.
    scheduler_address: str = ""
    scheduler_token: str = field(default="", repr=False)
    deploy_attempts: int = 3
    lease_ttl_s: int = 2
    # Each learner controller's lease (LEARNER_LEASE_TTL_ENV says why it is longer).
    learner_lease_ttl_s: int = DEFAULT_LEARNER_LEASE_TTL_S
    learner_grace_s: float = 10.0
    # A controller this guardian started must claim its rank within this time.
    start_grace_s: float = 20.0
    # Restarts after controller deaths (the platform's failures) before giving up.
    platform_restarts: int = 50
    # Test hooks: pause after recording each step as started; fail a step on attempts < N.
    step_delay_s: float = 0.0
    fail_step: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def jobs_dir(self) -> Path:
        return self.data_dir / "jobs"

    @property
    def objects_dir(self) -> Path:
        """The object store's volume (the daemon exports `--object-store`); for an s3://
        store the paths under it only name the objects, which the backend grants."""
        store = os.environ.get("RHIZOME_OBJECT_STORE", "")
        if store and "://" not in store:
            return Path(store)
        return self.data_dir / "objects"

    @classmethod
    def from_env(cls, **kwargs: Any) -> GuardianConfig:
        env = os.environ
        config = cls(**kwargs)
        config.deploy_attempts = int(env.get("RHIZOME_DEPLOY_ATTEMPTS", config.deploy_attempts))
        config.step_delay_s = float(env.get("RHIZOME_GUARDIAN_STEP_DELAY_S", config.step_delay_s))
        config.fail_step = env.get("RHIZOME_GUARDIAN_FAIL_STEP", config.fail_step)
        config.learner_grace_s = float(env.get("RHIZOME_LEARNER_GRACE_S", config.learner_grace_s))
        config.learner_lease_ttl_s = learner_lease_ttl_from_env(env)
        if config.deploy_attempts < 1:
            raise ValueError("RHIZOME_DEPLOY_ATTEMPTS must be at least 1")
        return config
