"""Abstract interfaces and typed errors of the checkpointing layer.

Modelled on torch.distributed.elastic: the abstract classes live here, the backends in
their own modules, registered by name (`notices.register`, `storage.open_store`).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class CheckpointError(Exception):
    """Base class of every error this package raises."""


class StorageError(CheckpointError):
    """The object store refused an operation (missing source, bad name, I/O error)."""


class NoticeSourceError(CheckpointError):
    """A preemption notice source is unknown or misconfigured."""


class CheckpointKind(enum.StrEnum):
    """Why a checkpoint was taken; drives garbage collection.

    - `PERIODIC`: the script saved on its own schedule (kept, up to `RHIZOME_KEEP` + newest).
    - `INSURANCE`: the policy asked for it at the Daly interval (dropped once a newer one is
      committed).
    - `EMERGENCY`: taken after a preemption notice (dropped once a newer one is committed).
    """

    PERIODIC = "periodic"
    INSURANCE = "insurance"
    EMERGENCY = "emergency"


@dataclass(frozen=True)
class PreemptionNotice:
    """A preemption is coming: `source` saw it at `received_at` (time.time()) and the
    node goes away at `deadline` (time.time()); `ack` is a callback a source may provide
    to tell the cloud the learner is ready (Azure scheduled events)."""

    source: str
    received_at: float
    deadline: float
    detail: dict[str, Any] = field(default_factory=dict)

    def time_left(self, now: float) -> float:
        return max(0.0, self.deadline - now)


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A checkpoint the store has committed: only these are ever returned for resume."""

    name: str
    path: Path
    step: int
    kind: CheckpointKind
    committed_at: float
    seq: int
    metadata: dict[str, Any] = field(default_factory=dict)


NoticeCallback = Callable[[PreemptionNotice], None]


class PreemptionNoticeSource(abc.ABC):
    """Something that can tell a learner it is about to be preempted.

    `start(callback)` begins watching (installing a signal handler, or polling an endpoint
    from a daemon thread) and calls `callback(notice)` at most once per preemption;
    `stop()` ends the watch. `acknowledge(notice)` tells the source the learner is done
    with it (a no-op for sources with nothing to tell).
    """

    name: str = "abstract"

    @abc.abstractmethod
    def start(self, callback: NoticeCallback) -> None: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    def acknowledge(self, notice: PreemptionNotice) -> None:  # noqa: B027 - optional hook
        """Default: nothing to tell."""


class ObjectStore(abc.ABC):
    """Where checkpoints are backed up. Commit is atomic: a checkpoint is either fully
    there and marked committed, or invisible to `latest()`."""

    @abc.abstractmethod
    def commit(
        self,
        source: Path,
        *,
        step: int,
        kind: CheckpointKind,
        metadata: dict[str, Any] | None = None,
    ) -> CommittedCheckpoint: ...

    @abc.abstractmethod
    def list_committed(self) -> list[CommittedCheckpoint]: ...

    def latest(self) -> CommittedCheckpoint | None:
        committed = self.list_committed()
        return committed[-1] if committed else None

    @abc.abstractmethod
    def delete(self, checkpoint: CommittedCheckpoint) -> None: ...
