"""Object storage for model definitions, checkpoints and results: a local directory.

Writes are atomic (temp file, fsync, rename) so a crash never leaves a half-written
object that a reader could pick up.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


class LocalObjectStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, key: str) -> Path:
        if key.startswith("/") or ".." in Path(key).parts:
            raise ValueError(f"object key {key!r} must be relative and stay inside the store")
        return self.root / key

    def put(self, key: str, data: bytes) -> Path:
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        return target

    def get(self, key: str) -> bytes:
        return self.path(key).read_bytes()

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(key).unlink()
