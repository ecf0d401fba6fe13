"""Object stores for checkpoint backups, opened by URL scheme.

Only the local-directory store is built (`file://` or a plain path). An S3-compatible
store would go behind the same `ObjectStore` interface, but there is no S3-compatible
server on these machines to test it against honestly, so it is not built:
`open_store("s3://...")` says so.

Layout of a local store (one per job and learner)::

    <root>/<job>/<learner>/
        .tmp-<uuid>/                      being written: never listed
        ckpt-00000007-insurance-s120/     renamed into place after fsync
            <payload file or directory>
            rhizome-meta.json
            COMMITTED                     written last: only now is it visible

A writer killed at any point leaves either a `.tmp-*` directory or a renamed directory
without `COMMITTED`; `list_committed()` skips both, and the next store opened on the same
place removes them.
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


class LocalDirectoryStore(ObjectStore):
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
        if not source.exists():
            raise StorageError(
                f"cannot back up {source}: it does not exist; call backup() with the path "
                "the script just saved to"
            )
        if step < 0:
            raise StorageError(f"step must be >= 0, got {step}")
        entries = self._entries()
        seq = entries[-1][0] + 1 if entries else 1
        tmp = self.root / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            target = tmp / source.name
            if source.is_dir():
                shutil.copytree(source, target)
            else:
                shutil.copy2(source, target)
            committed_at = time.time()
            meta = {
                "step": step,
                "kind": kind.value,
                "seq": seq,
                "payload": source.name,
                "committed_at": committed_at,
                "metadata": metadata or {},
            }
            (tmp / META_FILE).write_text(json.dumps(meta, sort_keys=True))
            _fsync_tree(tmp)
            final = self.root / f"ckpt-{seq:08d}-{kind.value}-s{step}"
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
        return CommittedCheckpoint(
            name=final.name,
            path=final / source.name,
            step=step,
            kind=kind,
            committed_at=committed_at,
            seq=seq,
            metadata=meta["metadata"],  # type: ignore[arg-type]
        )

    def _load(self, path: Path) -> CommittedCheckpoint | None:
        if not (path / COMMITTED_MARKER).exists():
            return None
        try:
            meta = json.loads((path / META_FILE).read_text())
        except (OSError, ValueError):
            return None
        return CommittedCheckpoint(
            name=path.name,
            path=path / str(meta["payload"]),
            step=int(meta["step"]),
            kind=CheckpointKind(meta["kind"]),
            committed_at=float(meta["committed_at"]),
            seq=int(meta["seq"]),
            metadata=dict(meta.get("metadata") or {}),
        )

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

    def collect_garbage(self) -> list[CommittedCheckpoint]:
        """Drop insurance/emergency checkpoints older than the newest committed one, and
        periodic ones beyond `keep_periodic` besides the newest. Returns what was deleted."""
        committed = self.list_committed()
        if not committed:
            return []
        newest = committed[-1]
        deleted = []
        older = committed[:-1]
        periodic_kept = 0
        for ckpt in reversed(older):
            if ckpt.kind is CheckpointKind.PERIODIC and periodic_kept < self.keep_periodic:
                periodic_kept += 1
                continue
            self.delete(ckpt)
            deleted.append(ckpt)
        del newest
        return deleted


def open_store(url: str | Path, *, keep_periodic: int = 1) -> ObjectStore:
    """`/path`, `file:///path` -> LocalDirectoryStore; `s3://` is not built (see module doc)."""
    text = str(url)
    if text.startswith("s3://"):
        raise StorageError(
            f"{text}: the S3-compatible store is not built (no S3-compatible server here to "
            "test it against); use a local directory or a mounted volume for "
            "RHIZOME_CHECKPOINT_DIR"
        )
    if text.startswith("file://"):
        text = text[len("file://") :]
    elif "://" in text:
        raise StorageError(f"{text}: unknown store scheme; use a directory path or file://")
    return LocalDirectoryStore(Path(text), keep_periodic=keep_periodic)
