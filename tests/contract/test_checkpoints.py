"""The platform's reading of local checkpoints (contract/checkpoints.py) agrees with what
the checkpoint SDK commits (learner/checkpoint/storage.py)."""

from __future__ import annotations

from pathlib import Path

from contract.checkpoints import COMMITTED_MARKER, newest_commit
from learner.checkpoint.api import CheckpointKind
from learner.checkpoint.storage import COMMITTED_MARKER as SDK_MARKER
from learner.checkpoint.storage import LocalDirectoryStore


def test_the_newest_commit_of_any_learner_is_found_with_its_step(tmp_path: Path) -> None:
    assert COMMITTED_MARKER == SDK_MARKER
    root = tmp_path / "checkpoints"
    assert newest_commit(root) is None
    payload = tmp_path / "model.pt"
    payload.write_bytes(b"weights")
    first = LocalDirectoryStore(root / "job" / "learner-0").commit(
        payload, step=10, kind=CheckpointKind.PERIODIC
    )
    second = LocalDirectoryStore(root / "job" / "learner-1").commit(
        payload, step=12, kind=CheckpointKind.EMERGENCY
    )
    found = newest_commit(root)
    assert found is not None
    assert (found.committed_at, found.step) == (second.committed_at, 12)
    assert found.committed_at >= first.committed_at


def test_a_checkpoint_without_its_marker_is_not_counted(tmp_path: Path) -> None:
    (tmp_path / "job" / "l" / "ckpt-00000001-periodic-s5").mkdir(parents=True)
    assert newest_commit(tmp_path) is None
