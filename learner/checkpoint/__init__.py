"""Adaptive checkpointing (Spotify): preemption notices, the Daly/emergency policy, atomic
backups to an object store, and the manager that gathers them for `learner.sdk`.

One module per concern (the environment variables are `contract.env.LearnerEnv`): `api`
(abstract classes and errors), `policy` (pure functions), `notices` (notice sources by name), `storage` (object
stores), `manager` (the context object and its dummy twin).
"""

from learner.checkpoint.api import (
    CheckpointError,
    CheckpointKind,
    CommittedCheckpoint,
    NoticeSourceError,
    ObjectStore,
    PreemptionNotice,
    PreemptionNoticeSource,
    StorageError,
)
from learner.checkpoint.policy import daly_interval, emergency_save_fits

__all__ = [
    "CheckpointError",
    "CheckpointKind",
    "CommittedCheckpoint",
    "NoticeSourceError",
    "ObjectStore",
    "PreemptionNotice",
    "PreemptionNoticeSource",
    "StorageError",
    "daly_interval",
    "emergency_save_fits",
]
