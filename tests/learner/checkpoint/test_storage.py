"""Atomic commit, latest(), garbage collection, and checkpoints interrupted mid-write."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.checkpoint.api import CheckpointKind, StorageError
from learner.checkpoint.storage import COMMITTED_MARKER, LocalDirectoryStore, open_store
from tests.learner.checkpoint.helpers import kill_writer_when_ready


def _payload(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_commit_then_latest_returns_the_newest(tmp_path: Path) -> None:
    store = LocalDirectoryStore(tmp_path / "s")
    store.commit(_payload(tmp_path, "a", "one"), step=10, kind=CheckpointKind.PERIODIC)
    second = store.commit(_payload(tmp_path, "a", "two"), step=20, kind=CheckpointKind.INSURANCE)
    latest = store.latest()
    assert latest is not None and latest.name == second.name
    assert latest.step == 20 and latest.kind is CheckpointKind.INSURANCE
    assert latest.path.read_text() == "two"


def test_directories_are_backed_up_whole(tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    (src / "shard").mkdir(parents=True)
    (src / "shard" / "0.bin").write_bytes(b"x" * 10)
    store = LocalDirectoryStore(tmp_path / "s")
    got = store.commit(src, step=1, kind=CheckpointKind.PERIODIC)
    assert (got.path / "shard" / "0.bin").read_bytes() == b"x" * 10


def test_newer_commit_garbage_collects_insurance_and_emergency(tmp_path: Path) -> None:
    store = LocalDirectoryStore(tmp_path / "s", keep_periodic=1)
    p = _payload(tmp_path, "a", "x")
    store.commit(p, step=1, kind=CheckpointKind.PERIODIC)
    store.commit(p, step=2, kind=CheckpointKind.PERIODIC)
    store.commit(p, step=3, kind=CheckpointKind.INSURANCE)
    store.commit(p, step=4, kind=CheckpointKind.EMERGENCY)
    deleted = store.collect_garbage()
    assert sorted(c.step for c in deleted) == [1, 3]
    assert [c.step for c in store.list_committed()] == [2, 4]


def test_missing_source_and_unknown_schemes_are_clear_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalDirectoryStore(tmp_path / "s")
    with pytest.raises(StorageError, match="does not exist"):
        store.commit(tmp_path / "nope", step=1, kind=CheckpointKind.PERIODIC)
    monkeypatch.delenv("RHIZOME_S3_ENDPOINT_URL", raising=False)
    with pytest.raises(StorageError, match="RHIZOME_S3_ENDPOINT_URL is not set"):
        open_store("s3://bucket/x")
    with pytest.raises(StorageError, match="unknown store scheme"):
        open_store("gs://bucket/x")
    assert isinstance(open_store(f"file://{tmp_path / 'f'}"), LocalDirectoryStore)


def test_uncommitted_leftovers_are_never_listed(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = LocalDirectoryStore(root)
    good = store.commit(_payload(tmp_path, "a", "good"), step=5, kind=CheckpointKind.PERIODIC)
    (root / ".tmp-deadbeef").mkdir()
    (root / ".tmp-deadbeef" / "a").write_text("half")
    renamed = root / "ckpt-00000009-insurance-s99"
    renamed.mkdir()
    (renamed / "a").write_text("half")
    listed = LocalDirectoryStore(root, clean_partial=False)
    assert [c.name for c in listed.list_committed()] == [good.name]
    reopened = LocalDirectoryStore(root)  # a new writer cleans up
    assert not renamed.exists() and not (root / ".tmp-deadbeef").exists()
    assert reopened.latest() is not None and reopened.latest().step == 5  # type: ignore[union-attr]


_WRITER = """
import os, sys, time, pathlib
sys.path.insert(0, {repo!r})
from learner.checkpoint import storage
from learner.checkpoint.api import CheckpointKind
root, src, ready, stage = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3], sys.argv[4]
store = storage.LocalDirectoryStore(root)
src.write_text("complete-1")
store.commit(src, step=1, kind=CheckpointKind.PERIODIC)
src.write_text("complete-2" * 1000)

def hang():
    open(ready, "w").close()
    time.sleep(600)

if stage == "copy":
    def partial_copy(a, b, **kw):
        pathlib.Path(b).write_text("compl")
        hang()
    storage.shutil.copy2 = partial_copy
else:
    real_rename = os.rename
    def rename_then_hang(a, b):
        real_rename(a, b)
        hang()
    storage.os.rename = rename_then_hang
store.commit(src, step=2, kind=CheckpointKind.INSURANCE)
"""


@pytest.mark.parametrize("stage", ["copy", "rename"])
def test_checkpoint_killed_mid_write_is_never_picked(tmp_path: Path, stage: str) -> None:
    root, ready = tmp_path / "store", tmp_path / "ready"
    args = [str(root), str(tmp_path / "model.pt"), str(ready), stage]
    kill_writer_when_ready(_WRITER, args, ready, "the write")
    leftovers = [p.name for p in root.iterdir() if p.name.startswith((".tmp-", "ckpt-"))]
    assert len(leftovers) == 2, f"expected the good checkpoint and one partial, got {leftovers}"
    store = LocalDirectoryStore(root, clean_partial=False)
    latest = store.latest()
    assert latest is not None and latest.step == 1
    assert latest.path.read_text() == "complete-1"
    partial = [p for p in root.iterdir() if p.name != latest.name and p.is_dir()]
    assert partial and not (partial[0] / COMMITTED_MARKER).exists()
