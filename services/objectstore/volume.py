"""`VolumeStore`: the object store as a directory (a local disk, or a shared volume such
as NFS mounted at the same path wherever learners run).

Writes are atomic (temp file, fsync, rename) so a crash never leaves a half-written
object that a reader could pick up. Learners get no credentials: the backend mounts
exactly their job's objects (docker: services/backends/docker/spec.py `data_mounts`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import IO, Any

from services.objectstore.api import ObjectNotFound, ObjectStore, ObjectStoreError, check_key


class VolumeStore(ObjectStore):
    remote = False

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.url = str(self.root)

    @classmethod
    def from_url(cls, url: str, **_: Any) -> VolumeStore:
        return cls(Path(url.removeprefix("file://")).expanduser())

    def path(self, key: str) -> Path:
        return self.root / check_key(key)

    def local_path(self, key: str) -> Path | None:
        return self.path(key)

    def put(self, key: str, data: bytes) -> None:
        self._write(key, lambda fh: fh.write(data))

    def put_file(self, key: str, file: IO[bytes]) -> None:
        self._write(key, lambda fh: shutil.copyfileobj(file, fh, 1024 * 1024))

    def _write(self, key: str, fill: Any) -> None:
        target = self.path(key)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as fh:
                fill(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise ObjectStoreError(f"cannot store {key} in {self.root}: {exc}") from exc

    def get(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key} in {self.root}") from None

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    def list_keys(self, prefix: str) -> list[str]:
        folder = self.path(prefix)
        if not folder.is_dir():
            return []
        # Regular files only: a learner's results folder may hold a link to anywhere.
        return sorted(
            p.relative_to(self.root).as_posix()
            for p in folder.rglob("*")
            if p.is_file() and not p.is_symlink() and not p.name.startswith(".")
        )

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(key).unlink()


def open_volume(url: str, **_: Any) -> VolumeStore:
    """The registry's factory for paths and `file://` URLs."""
    return VolumeStore.from_url(url)
