"""The security interface: who is calling an internal service, and the typed errors.

The internal port (LifecycleManager, TrainingData, Scheduler) admits two kinds of caller:
the platform's own processes, with the per-daemon *service* credential, and a job's
learners, with a *job token* that names one job and can only append to and read that
job's logs and metrics. `ServiceCredentials` issues and checks both; `internal.py` holds
the shared-secret implementation and the gRPC interceptors, `tls.py` the certificates.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# gRPC metadata key that carries either credential, as `Bearer <token>`.
AUTHORIZATION_METADATA = "authorization"
# How the LCM hands a guardian its job's token: in the guardian's environment (never on
# its command line, which any local user can read), popped before learners start.
JOB_TOKEN_ENV = "RHIZOME_JOB_TOKEN"
# How the LCM hands a guardian its store URIs, for the same reason: either may carry a
# password (`mongodb://user:PASSWORD@...`), and /proc/PID/cmdline is readable by every
# local user, learner uids included, while /proc/PID/environ is not. Popped by the guardian.
GUARDIAN_ETCD_URL_ENV = "RHIZOME_GUARDIAN_ETCD_URL"
GUARDIAN_MONGODB_URI_ENV = "RHIZOME_GUARDIAN_MONGODB_URI"
# The service credential, for the guardian's calls to the scheduler's internal port
# (ReplaceLearner for a lost pipeline learner); same way, popped by the guardian.
GUARDIAN_SERVICE_TOKEN_ENV = "RHIZOME_GUARDIAN_SERVICE_TOKEN"
# The job's mutual-TLS client certificate for the TDS (JSON `{ca, cert, key}`), the same
# way: the key is a secret. Unset on a plaintext platform.
JOB_TLS_ENV = "RHIZOME_JOB_TLS"
# The job's own etcd user (`USER:PASSWORD`, scoped to the job's prefix), the same way:
# the LCM makes it with etcd's root user, the guardian pops it and puts it in each
# learner's 0600 spec. Unset where etcd has no authentication.
JOB_ETCD_CREDENTIALS_ENV = "RHIZOME_JOB_ETCD_CREDENTIALS"
# The CA directory of the internal port, so that the guardian can re-issue its job's
# short-lived TDS certificate (services/security/tls.py `renewal_due`). Popped too.
JOB_TLS_DIR_ENV = "RHIZOME_JOB_TLS_DIR"


HOW_TO_AUTHENTICATE = (
    "internal services (LifecycleManager, TrainingData, Scheduler) take the daemon's service "
    "credential (`authorization: Bearer <contents of <data dir>/internal.secret>`) or, for a "
    "job's learners, the job token in their learner spec; users call the public port's "
    "Trainer API instead"
)


class SecurityError(Exception):
    """Base of the security errors; the message says what is wrong and how to fix it."""


class CredentialError(SecurityError):
    """A missing, malformed or wrong credential (UNAUTHENTICATED)."""


class TlsError(SecurityError):
    """Certificates that cannot be generated, read or used together."""


@dataclass(frozen=True)
class Caller:
    """Who called an internal service: the platform itself, or one job's learners."""

    job_id: str = ""  # empty: a platform process holding the service credential

    @property
    def is_service(self) -> bool:
        return not self.job_id


class ServiceCredentials(abc.ABC):
    """Issues and checks the internal port's credentials."""

    @abc.abstractmethod
    def service_token(self) -> str:
        """The credential platform processes send to each other's internal ports."""

    @abc.abstractmethod
    def job_token(self, job_id: str) -> str:
        """The credential of `job_id`'s learners: its own logs and metrics only."""

    @abc.abstractmethod
    def identify(self, token: str) -> Caller:
        """Who holds `token`; raises CredentialError when it is neither credential."""

    def caller(self, metadata: Iterable[tuple[str, Any]] | None) -> Caller:
        """Who sent `metadata`; CredentialError when there is no valid credential."""
        for key, value in metadata or ():
            if key == AUTHORIZATION_METADATA:
                scheme, _, token = str(value).strip().partition(" ")
                if scheme.lower() != "bearer" or not token.strip():
                    raise CredentialError(
                        f"malformed authorization: expected `Bearer <token>`; {HOW_TO_AUTHENTICATE}"
                    )
                return self.identify(token.strip())
        raise CredentialError(f"no service credential: {HOW_TO_AUTHENTICATE}")
