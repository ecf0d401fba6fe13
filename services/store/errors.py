"""Typed errors of the store layer; the API maps each to a status code and a clear message."""

from __future__ import annotations

# MongoDB or etcd cannot be reached; the message names which and where. Defined with the
# one etcd client (the learners raise it too); re-exported here for the platform's stores.
from contract.etcd import StoreUnavailable


class StoreError(RuntimeError):
    """Base class of the store errors below."""


class JobNotFound(StoreError, LookupError):
    def __init__(self, job_id: str) -> None:
        super().__init__(
            f"no job {job_id!r} (check the id with `rhizome list`; you only see your own jobs)"
        )
        self.job_id = job_id


class IdempotencyConflict(StoreError):
    """The idempotency key was used before with a different manifest."""

    def __init__(self, key: str, job_id: str) -> None:
        super().__init__(
            f"idempotency key {key!r} was already used for job {job_id} with a different "
            "manifest; use a new key for a new job"
        )
        self.key = key
        self.job_id = job_id


class StaleToken(StoreError):
    """A compare-and-set lost: someone else changed the record since it was read."""


__all__ = [
    "IdempotencyConflict",
    "JobNotFound",
    "StaleToken",
    "StoreError",
    "StoreUnavailable",
]
