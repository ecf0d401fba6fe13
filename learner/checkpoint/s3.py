"""`S3Store`: checkpoint backups in any S3-compatible object store.

Opened by `storage.open_store("s3://bucket/prefix")` (imported lazily: only jobs that use
it need `boto3`). Configuration, all from the environment:

- `RHIZOME_S3_ENDPOINT_URL` (required): the server (`http://127.0.0.1:9000` for MinIO,
  moto, Ceph…; `https://s3.<region>.amazonaws.com` for AWS, untested). Required rather
  than defaulting to AWS, so a store never talks to a server nobody named.
- `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_DEFAULT_REGION`
  (default `us-east-1`), or any other source boto3 reads credentials from.

Layout under the prefix, the same as the local store's::

    <prefix>/ckpt-00000007-insurance-s120/
        <payload file, or the files of the payload directory>
        rhizome-meta.json
        COMMITTED                 uploaded LAST: it is the commit

S3 has no rename, so the checkpoint's own prefix is its staging area: objects are uploaded
one by one, then `rhizome-meta.json`, then `COMMITTED`. `list_committed()` lists only
prefixes holding `COMMITTED`; a writer killed mid-upload leaves a prefix without it, which
is never listed and is removed by the next store opened with `clean_partial=True` (the
default, as for the local store; open with `clean_partial=False` while a writer runs).
Delete removes `COMMITTED` first. Names, sequence numbers, metadata and garbage collection
are the shared ones of `learner.checkpoint.storage`.

`CommittedCheckpoint.path` of an S3 checkpoint is the payload's key in the bucket (a
relative path, nothing on local disk); `fetch(checkpoint, dest)` downloads it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import boto3
import boto3.exceptions
import botocore.exceptions
from botocore.config import Config

from contract import env as learner_vars
from learner.checkpoint.api import CheckpointKind, CommittedCheckpoint, StorageError
from learner.checkpoint.storage import (
    COMMITTED_MARKER,
    META_FILE,
    GarbageCollectingStore,
    check_commit_args,
    checkpoint_from_meta,
    checkpoint_name,
    meta_record,
    next_seq,
    parse_name,
)

ENDPOINT_ENV = learner_vars.S3_ENDPOINT_URL
_DELETE_BATCH = 1000  # the most keys one DeleteObjects call takes
_ERRORS = (
    botocore.exceptions.BotoCoreError,
    botocore.exceptions.ClientError,
    boto3.exceptions.Boto3Error,
)


def _client_from_env(endpoint_url: str) -> Any:
    config = Config(connect_timeout=5, read_timeout=60, retries={"max_attempts": 3})
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        config=config,
    )


class S3Store(GarbageCollectingStore):
    """Checkpoints under `s3://bucket/prefix`; atomic by uploading the marker last."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        keep_periodic: int = 1,
        clean_partial: bool = True,
        endpoint_url: str | None = None,
        client: Any = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.keep_periodic = keep_periodic
        self.endpoint_url = endpoint_url or os.environ.get(ENDPOINT_ENV) or ""
        if not self.endpoint_url and client is None:
            raise StorageError(
                f"{self.url}: {ENDPOINT_ENV} is not set; set it to the URL of the "
                "S3-compatible server (e.g. http://127.0.0.1:9000; for AWS "
                "https://s3.<region>.amazonaws.com)"
            )
        self.client = client if client is not None else _client_from_env(self.endpoint_url)
        self._check_bucket()
        if clean_partial:
            self.remove_partial()

    @classmethod
    def from_url(cls, url: str, *, keep_periodic: int = 1, clean_partial: bool = True) -> S3Store:
        """`s3://bucket` or `s3://bucket/some/prefix`."""
        if not url.startswith("s3://"):
            raise StorageError(f"{url}: not an s3:// URL")
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket:
            raise StorageError(f"{url}: no bucket; write s3://BUCKET/PREFIX")
        return cls(bucket, prefix, keep_periodic=keep_periodic, clean_partial=clean_partial)

    # -- errors ----------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def _where(self) -> str:
        return f"{self.url} at {self.endpoint_url or 'the client endpoint'}"

    def _error(self, what: str, err: Exception) -> StorageError:
        """A StorageError that names the store and says how to fix the usual causes."""
        if isinstance(err, botocore.exceptions.EndpointConnectionError | ConnectionError):
            return StorageError(
                f"{what} {self._where()}: cannot reach the endpoint ({err}); start the "
                f"S3-compatible server or set {ENDPOINT_ENV} to its URL"
            )
        if isinstance(err, botocore.exceptions.NoCredentialsError):
            return StorageError(
                f"{what} {self._where()}: no credentials; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY"
            )
        if isinstance(err, botocore.exceptions.ClientError):
            code = str(err.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchBucket"):
                return StorageError(
                    f"{what} {self._where()}: bucket {self.bucket!r} does not exist; create "
                    f"it (e.g. aws s3 mb s3://{self.bucket} --endpoint-url "
                    f"{self.endpoint_url or '<url>'}) or fix the bucket in the URL"
                )
            if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return StorageError(
                    f"{what} {self._where()}: access denied ({code}); check "
                    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket policy"
                )
        return StorageError(f"{what} {self._where()}: {err}")

    def _check_bucket(self) -> None:
        # A listing of our own prefix, not HeadBucket: credentials scoped to the job's
        # prefix (the platform's object store grants, services/objectstore/s3.py) may
        # list that prefix and nothing else, and HeadBucket needs the whole bucket.
        try:
            prefix = f"{self.prefix}/" if self.prefix else ""
            self.client.list_objects_v2(Bucket=self.bucket, Prefix=prefix, MaxKeys=1)
        except _ERRORS as err:
            raise self._error("cannot open checkpoint store", err) from err

    # -- keys ------------------------------------------------------------------------
    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _keys(self, sub: str = "") -> Iterator[str]:
        """Every key under the store's prefix (or under `sub` inside it)."""
        base = self._key(sub)
        prefix = f"{base}/" if base else ""
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                yield str(obj["Key"])

    def _checkpoints(self) -> dict[str, set[str]]:
        """Checkpoint name -> the keys under it (relative to the checkpoint's prefix)."""
        skip = len(self.prefix) + 1 if self.prefix else 0
        out: dict[str, set[str]] = {}
        for key in self._keys():
            name, sep, rest = key[skip:].partition("/")
            if sep and parse_name(name) is not None:
                out.setdefault(name, set()).add(rest)
        return out

    def _delete_keys(self, keys: list[str]) -> None:
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = [{"Key": k} for k in keys[i : i + _DELETE_BATCH]]
            resp = self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
            )
            errors = resp.get("Errors") or []
            if errors and all(e.get("Code") == "AccessDenied" for e in errors):
                # Some servers (moto) authorize a batch delete on the bucket as a whole,
                # which credentials scoped to our prefix may not touch: one by one then.
                errors = self._delete_one_by_one([str(e["Key"]) for e in errors])
            if errors:
                raise StorageError(f"cannot delete from {self._where()}: {errors[:3]}")

    def _delete_one_by_one(self, keys: list[str]) -> list[dict[str, str]]:
        failed = []
        for key in keys:
            try:
                self.client.delete_object(Bucket=self.bucket, Key=key)
            except botocore.exceptions.ClientError as err:
                failed.append({"Key": key, "Code": str(err.response.get("Error", {}).get("Code"))})
        return failed

    # -- ObjectStore -----------------------------------------------------------------
    def remove_partial(self) -> list[str]:
        """Delete checkpoints without `COMMITTED` (only call while no writer runs)."""
        try:
            removed = []
            for name, rel in sorted(self._checkpoints().items()):
                if COMMITTED_MARKER not in rel:
                    self._delete_keys([self._key(name, r) for r in sorted(rel)])
                    removed.append(name)
            return removed
        except _ERRORS as err:
            raise self._error("cannot clean partial checkpoints in", err) from err

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
        try:
            seqs = [s for s in map(parse_name, self._checkpoints()) if s is not None]
            seq = next_seq(seqs)
            name = checkpoint_name(seq, kind, step)
            if source.is_dir():
                files = sorted(p for p in source.rglob("*") if p.is_file())
                for path in files:
                    rel = PurePosixPath(source.name, *path.relative_to(source).parts)
                    self.client.upload_file(str(path), self.bucket, self._key(name, str(rel)))
            else:
                self.client.upload_file(str(source), self.bucket, self._key(name, source.name))
            committed_at = time.time()
            meta = meta_record(
                step=step,
                kind=kind,
                seq=seq,
                payload=source.name,
                committed_at=committed_at,
                metadata=metadata,
            )
            self.client.put_object(
                Bucket=self.bucket,
                Key=self._key(name, META_FILE),
                Body=json.dumps(meta, sort_keys=True).encode(),
            )
            # The commit: a PUT is atomic and S3 reads are strongly consistent, so once
            # this returns every reader that lists the marker sees the complete checkpoint.
            self.client.put_object(
                Bucket=self.bucket,
                Key=self._key(name, COMMITTED_MARKER),
                Body=str(committed_at).encode(),
            )
        except _ERRORS as err:
            raise self._error(f"cannot back up {source} to", err) from err
        return checkpoint_from_meta(name, Path(self._key(name, source.name)), meta)

    def _load(self, name: str) -> CommittedCheckpoint | None:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(name, META_FILE))
            meta = json.loads(body["Body"].read())
        except botocore.exceptions.ClientError:
            return None  # marker without meta: treated as not committed
        except ValueError:
            return None
        return checkpoint_from_meta(name, Path(self._key(name, str(meta["payload"]))), meta)

    def list_committed(self) -> list[CommittedCheckpoint]:
        try:
            entries = sorted(
                (seq, name)
                for name, rel in self._checkpoints().items()
                if COMMITTED_MARKER in rel and (seq := parse_name(name)) is not None
            )
            out = []
            for _seq, name in entries:
                ckpt = self._load(name)
                if ckpt is not None:
                    out.append(ckpt)
            return out
        except _ERRORS as err:
            raise self._error("cannot list checkpoints in", err) from err

    def delete(self, checkpoint: CommittedCheckpoint) -> None:
        try:
            # Unmark first, so a crash half-way through never leaves a listed checkpoint
            # with missing objects.
            self.client.delete_object(
                Bucket=self.bucket, Key=self._key(checkpoint.name, COMMITTED_MARKER)
            )
            self._delete_keys(list(self._keys(checkpoint.name)))
        except _ERRORS as err:
            raise self._error(f"cannot delete {checkpoint.name} from", err) from err

    def fetch(self, checkpoint: CommittedCheckpoint, dest: Path) -> Path:
        """Download the payload of `checkpoint` into directory `dest`; returns the local
        payload path (the file, or the directory the script backed up)."""
        dest = Path(dest)
        base = self._key(checkpoint.name)
        try:
            for key in self._keys(checkpoint.name):
                rel = key[len(base) + 1 :]
                if rel in (META_FILE, COMMITTED_MARKER):
                    continue
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                self.client.download_file(self.bucket, key, str(target))
        except _ERRORS as err:
            raise self._error(f"cannot fetch {checkpoint.name} from", err) from err
        return dest / checkpoint.path.name
