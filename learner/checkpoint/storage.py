"""Object stores for checkpoint backups, opened by URL scheme.

Two stores behind the same `ObjectStore` interface:

- `LocalDirectoryStore` (`file://` or a plain path), below.
- `S3Store` (`s3://bucket/prefix`) in `learner/checkpoint/s3.py`, imported lazily by
  `open_store` so `boto3` is only needed by jobs that use it. The endpoint comes from
  `RHIZOME_S3_ENDPOINT_URL` (any S3-compatible server), credentials from the standard
  AWS variables. Tested against moto's standalone server, not against AWS.

Both share the decisions made here: checkpoint names (`checkpoint_name`, `parse_name`),
the next sequence number (`next_seq`), the metadata record (`meta_record`,
`checkpoint_from_meta`) and garbage collection (`GarbageCollectingStore`,
`garbage_to_collect`). Only the storage mechanics differ.

Layout of a local store (one per job and learner)::

    <root>/<job>/<learner>/
        .tmp-<uuid>/                      being written: never listed
        ckpt-00000007-insurance-s120/     renamed into place after fsync
            <payload file or directory>
            rhizome-meta.json
            COMMITTED                     written last: only now is it visible

A writer killed at any point leaves either a `.tmp-*` directory or a renamed directory
without `COMMITTED`; `list_committed()` skips both, and the next store opened on the same
place removes them. The S3 store has the same layout under its prefix, without the
`.tmp-*` step (S3 has no rename): objects are uploaded under `ckpt-…/` and the
`COMMITTED` object is written last; it is the commit.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from learner.checkpoint.api import (
    CheckpointKind,
    CommittedCheckpoint,
    ObjectStore,
    StorageError,
)

COMMITTED_MARKER = "COMMITTED"
META_FILE = "rhizome-meta.json"
_NAME = re.compile(r"^ckpt-(?P<seq>\d{8})-(?P<kind>[a-z]+)-s(?P<step>\d+)$")


def checkpoint_name(seq: int, kind: CheckpointKind, step: int) -> str:
    """`ckpt-<seq>-<kind>-s<step>`: sorts by commit order (seq is zero-padded)."""
    return f"ckpt-{seq:08d}-{kind.value}-s{step}"


def parse_name(name: str) -> int | None:
    """The sequence number of a checkpoint name, or None for anything else."""
    m = _NAME.match(name)
    return int(m["seq"]) if m else None


def next_seq(existing: list[int]) -> int:
    """The seq of the next commit: above every name present, committed or not, so a new
    commit never reuses the name of a partial one."""
    return max(existing) + 1 if existing else 1


def check_commit_args(source: Path, step: int) -> None:
    if not source.exists():
        raise StorageError(
            f"cannot back up {source}: it does not exist; call backup() with the path "
            "the script just saved to"
        )
    if step < 0:
        raise StorageError(f"step must be >= 0, got {step}")


def meta_record(
    *,
    step: int,
    kind: CheckpointKind,
    seq: int,
    payload: str,
    committed_at: float,
    metadata: dict[str, Any] | None,
) -> dict[str, Any]:
    """What `rhizome-meta.json` holds."""
    return {
        "step": step,
        "kind": kind.value,
        "seq": seq,
        "payload": payload,
        "committed_at": committed_at,
        "metadata": metadata or {},
    }


def checkpoint_from_meta(name: str, path: Path, meta: dict[str, Any]) -> CommittedCheckpoint:
    """A `CommittedCheckpoint` from a `meta_record`; `path` is where the payload is."""
    return CommittedCheckpoint(
        name=name,
        path=path,
        step=int(meta["step"]),
        kind=CheckpointKind(meta["kind"]),
        committed_at=float(meta["committed_at"]),
        seq=int(meta["seq"]),
        metadata=dict(meta.get("metadata") or {}),
    )


def garbage_to_collect(
    committed: list[CommittedCheckpoint], keep_periodic: int
) -> list[CommittedCheckpoint]:
    """Of `committed` (oldest first), what garbage collection deletes: every checkpoint
    older than the newest except the `keep_periodic` most recent periodic ones."""
    doomed = []
    periodic_kept = 0
    for ckpt in reversed(committed[:-1]):
        if ckpt.kind is CheckpointKind.PERIODIC and periodic_kept < keep_periodic:
            periodic_kept += 1
            continue
        doomed.append(ckpt)
    return doomed


class GarbageCollectingStore(ObjectStore):
    """An `ObjectStore` with the shared garbage-collection rule (`garbage_to_collect`)."""

    keep_periodic: int = 1

    def collect_garbage(self) -> list[CommittedCheckpoint]:
        """Drop insurance/emergency checkpoints older than the newest committed one, and
        periodic ones beyond `keep_periodic` besides the newest. Returns what was deleted."""
        deleted = []
        for ckpt in garbage_to_collect(self.list_committed(), self.keep_periodic):
            self.delete(ckpt)
            deleted.append(ckpt)
        return deleted


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    if path.is_file():
        _fsync_path(path)
        return
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


class LocalDirectoryStore(GarbageCollectingStore):
    """Checkpoints in a directory; atomic by temp name + fsync + rename + marker."""

    def __init__(self, root: Path, *, keep_periodic: int = 1, clean_partial: bool = True) -> None:
        self.root = Path(root)
        self.keep_periodic = keep_periodic
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StorageError(
                f"cannot create checkpoint directory {self.root}: {err}; "
                "set RHIZOME_CHECKPOINT_DIR to a writable place"
            ) from err
        if clean_partial:
            self.remove_partial()

    def _entries(self) -> list[tuple[int, Path, re.Match[str]]]:
        out = []
        for child in self.root.iterdir():
            m = _NAME.match(child.name)
            if m and child.is_dir():
                out.append((int(m["seq"]), child, m))
        out.sort(key=lambda e: e[0])
        return out

    def remove_partial(self) -> list[Path]:
        """Delete what a killed writer left behind (only call while no writer runs)."""
        removed = []
        for child in self.root.iterdir():
            partial = child.name.startswith(".tmp-") or (
                _NAME.match(child.name) is not None and not (child / COMMITTED_MARKER).exists()
            )
            if partial:
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
        return removed

    def commit(
        self,
        source: Path,
        *,
        step: int,
        kind: CheckpointKind,
        metadata: dict[str, Any] | None = None,
    ) -> CommittedCheckpoint:
        source = Path(source)
        check_commit_args(source, step)
        seq = next_seq([e[0] for e in self._entries()])
        tmp = self.root / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            target = tmp / source.name
            if source.is_dir():
                shutil.copytree(source, target)
            else:
                shutil.copy2(source, target)
            committed_at = time.time()
            meta = meta_record(
                step=step,
                kind=kind,
                seq=seq,
                payload=source.name,
                committed_at=committed_at,
                metadata=metadata,
            )
            (tmp / META_FILE).write_text(json.dumps(meta, sort_keys=True))
            _fsync_tree(tmp)
            final = self.root / checkpoint_name(seq, kind, step)
            os.rename(tmp, final)
            marker = final / COMMITTED_MARKER
            with open(marker, "w") as fh:
                fh.write(str(committed_at))
                fh.flush()
                os.fsync(fh.fileno())
            _fsync_path(final)
            _fsync_path(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return checkpoint_from_meta(final.name, final / source.name, meta)

    def _load(self, path: Path) -> CommittedCheckpoint | None:
        if not (path / COMMITTED_MARKER).exists():
            return None
        try:
            meta = json.loads((path / META_FILE).read_text())
        except (OSError, ValueError):
            return None
        return checkpoint_from_meta(path.name, path / str(meta["payload"]), meta)

    def list_committed(self) -> list[CommittedCheckpoint]:
        out = []
        for _seq, path, _m in self._entries():
            ckpt = self._load(path)
            if ckpt is not None:
                out.append(ckpt)
        return out

    def delete(self, checkpoint: CommittedCheckpoint) -> None:
        path = self.root / checkpoint.name
        # Unmark first, so a crash half-way through the delete never leaves a listed
        # checkpoint with missing files.
        with contextlib.suppress(FileNotFoundError):
            (path / COMMITTED_MARKER).unlink()
        shutil.rmtree(path, ignore_errors=True)


def open_store(url: str | Path, *, keep_periodic: int = 1) -> ObjectStore:
    """`/path`, `file:///path` -> LocalDirectoryStore; `s3://bucket/prefix` -> S3Store
    (endpoint from `RHIZOME_S3_ENDPOINT_URL`, credentials from the AWS variables)."""
    text = str(url)
    if text.startswith("s3://"):
        try:
            from learner.checkpoint.s3 import S3Store
        except ImportError as err:
            raise StorageError(
                f"{text}: the S3 store needs boto3, which is not installed ({err}); "
                "pip install boto3, or use a local directory for RHIZOME_CHECKPOINT_DIR"
            ) from err
        return S3Store.from_url(text, keep_periodic=keep_periodic)
    if text.startswith("file://"):
        text = text[len("file://") :]
    elif "://" in text:
        raise StorageError(f"{text}: unknown store scheme; use a directory path or file://")
    return LocalDirectoryStore(Path(text), keep_periodic=keep_periodic)
