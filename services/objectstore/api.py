"""The platform's object store: where job code archives and results live, and how a
job's learners are given access to their own objects and nothing else.

Two kinds, chosen by platform configuration (`rhizomed --object-store`,
`PlatformConfig.object_store`; docs/backends.md, "Code and checkpoints"):

- a **shared volume** (a directory; the default is `<data dir>/objects`): learners see
  their job's files because the backend mounts exactly those (docker) — so they must run
  where that directory is mounted;
- an **S3-compatible object store** (`s3://bucket[/prefix]`, through boto3): learners on
  any machine fetch their code and keep their checkpoints there, with short-lived
  credentials scoped to their job (`grant`), carried to them in the learner spec.

Object keys are relative paths: `models/<job>.zip`, `results/<job>/<rank>/...`,
`checkpoints/<job>/<learner>/...` (the checkpoint SDK's layout).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from pathlib import Path
from typing import IO

from contract.learner_spec import StorageAccess
from contract.registry import Registry

# A job's credentials last this long unless configured: long enough for a deploy and a
# long training run, short enough that a leaked copy is soon worthless.
DEFAULT_GRANT_TTL_S = 12 * 3600


class ObjectStoreError(RuntimeError):
    """The store cannot do what was asked; the message names the store and the fix."""


class ObjectNotFound(ObjectStoreError):
    """No object under that key."""


class GrantError(ObjectStoreError):
    """Job-scoped credentials could not be issued or revoked."""


class UnknownObjectStore(ValueError):
    """The configured store's scheme is not one we know; the message lists those we do."""


def model_key(job_id: str) -> str:
    return f"models/{job_id}.zip"


def result_prefix(job_id: str) -> str:
    return f"results/{job_id}"


def checkpoint_prefix(job_id: str) -> str:
    """The checkpoint SDK stores a job's checkpoints under `<backup url>/<job>/<learner>`."""
    return f"checkpoints/{job_id}"


def check_key(key: str) -> str:
    """A key must be relative and stay inside the store."""
    parts = key.split("/")
    if not key or key.startswith("/") or ".." in parts or "" in parts:
        raise ObjectStoreError(f"object key {key!r} must be a relative path inside the store")
    return key


class ObjectStore(abc.ABC):
    """Code archives and results of jobs, and job-scoped access for learners."""

    url: str = ""
    # True when learners reach it over the network (they get a `StorageAccess`); False
    # for a volume, whose files the backend mounts into the learner.
    remote: bool = False

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store `data` atomically: a reader never sees half an object."""

    def put_file(self, key: str, file: IO[bytes]) -> None:
        """Store what `file` holds from its current position, atomically like `put`. A
        large upload (the API spools it to disk) need not be held in memory where the
        store can copy from a file; this default reads it whole."""
        self.put(key, file.read())

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The object's bytes; ObjectNotFound if there is none."""

    def list_keys(self, prefix: str) -> list[str]:
        """Every key under the folder `prefix` (e.g. `results/<job>`), sorted: what the
        API archives for the trained-model download."""
        raise ObjectStoreError(f"the object store {self.url} cannot list its objects")

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; no error if it is already gone."""

    def local_path(self, key: str) -> Path | None:
        """Where the object is as a file on this machine (a volume), else None."""
        return None

    def grant(self, job_id: str, *, with_model: bool, ttl_s: float) -> StorageAccess | None:
        """Credentials for job `job_id`'s learners: read its code archive (`with_model`),
        read and write its checkpoints and results, nothing else, for `ttl_s` seconds.
        None for a store learners reach as mounted files."""
        return None

    def revoke(self, job_id: str) -> None:
        """Make every credential issued for the job stop working (the job ended or its
        deploy is rolled back); safe to call any number of times. A volume issues no
        credentials, so there is nothing to revoke."""
        return None


ObjectStoreFactory = Callable[..., ObjectStore]
OBJECT_STORES: Registry[ObjectStoreFactory] = Registry(
    "object store scheme", error=UnknownObjectStore
)
OBJECT_STORES.register("file", "services.objectstore.volume:open_volume")
OBJECT_STORES.register("s3", "services.objectstore.s3:open_s3")


def open_object_store(url: str, *, default_dir: Path, endpoint_url: str = "") -> ObjectStore:
    """`""` -> a volume at `default_dir`; a path or `file:///path` -> a volume there;
    `s3://bucket[/prefix]` -> that bucket on `endpoint_url` (platform credentials from
    the standard AWS variables)."""
    if not url:
        url = str(default_dir)
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    return OBJECT_STORES.get(scheme)(url, endpoint_url=endpoint_url)
