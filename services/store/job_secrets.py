"""Data-store credentials kept out of the job record (issue #15).

A manifest's `data_stores[].connection` holds a store's settings and credentials (keys,
passwords, tokens). The record in MongoDB keeps only their names, each value replaced by
`***`, and a reference (`JobRecord.secrets`); the values go to
`<data dir>/secrets/<job id>.json`, mode 0600 in a 0700 directory, written before the
record is stored. The guardian resolves the reference when it deploys the job, so the
backend hands the learners their credentials the way it did (the job's 0400
`secrets/env`, a container's read-only mount, a Kubernetes Secret); the API, which reads
only records, has nothing to return. The file is removed when the job ends for good.

The file lives in the data directory of the daemon that took the submit: a guardian of a
daemon with another data directory (services split over machines without a shared data
directory) cannot resolve it and fails the deploy saying so (docs/security.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.manifest.types import REDACTED
from services.store import states

if TYPE_CHECKING:
    from services.store.jobs import JobsRepository

log = logging.getLogger(__name__)

SECRETS_DIR = "secrets"
# `JobRecord.secrets` of a record whose credentials are in the job's file.
SECRETS_IN_FILE = "file"


class JobSecretsError(RuntimeError):
    """A job's data-store credentials cannot be kept or found; the message says which."""


class JobSecrets:
    """The data-store credentials of jobs, one 0600 file per job under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @classmethod
    def in_data_dir(cls, data_dir: Path) -> JobSecrets:
        return cls(Path(data_dir) / SECRETS_DIR)

    def path(self, job_id: str) -> Path:
        if not job_id or "/" in job_id or job_id.startswith("."):
            raise JobSecretsError(f"{job_id!r} is not a job id")
        return self.root / f"{job_id}.json"

    def extract(self, job_id: str, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """Move every connection value of `manifest` into the job's file; return the
        manifest as the record keeps it (names, values `***`), or None when it has no
        connection values (nothing to keep, no file)."""
        stores = manifest.get("data_stores") or []
        values = {str(ds["id"]): dict(ds["connection"]) for ds in stores if ds.get("connection")}
        if not values:
            return None
        self._write(self.path(job_id), values)
        return redacted(manifest)

    def resolve(self, job_id: str, manifest: dict[str, Any]) -> dict[str, Any]:
        """`manifest` (as the record keeps it) with the connection values from the job's
        file."""
        path = self.path(job_id)
        try:
            values = json.loads(path.read_text())
        except FileNotFoundError:
            raise JobSecretsError(
                f"job {job_id}: its data-store credentials are not in {path} (the daemon that "
                "took the submit keeps them in its data directory): run its guardian with "
                "that --data-dir, or submit the job again"
            ) from None
        except (OSError, ValueError) as exc:
            raise JobSecretsError(f"job {job_id}: cannot read {path}: {exc}") from None
        resolved = dict(manifest)
        resolved["data_stores"] = [
            {**ds, "connection": dict(values.get(str(ds.get("id")), ds.get("connection") or {}))}
            for ds in manifest.get("data_stores") or []
        ]
        return resolved

    def migrate_inline(self, jobs: JobsRepository, batch: int = 200) -> list[str]:
        """Move the data-store credentials that records written before this store existed
        still hold inline (`secrets: ""` with connection values that are not `***`) out of
        them: the job's file first, then the record, redacted, by compare-and-set
        (`JobsRepository.update_fields`: a writer of the record in between makes it re-read
        and retry, so neither loses anything; a record's manifest is written once at submit
        and then only here, so the redacted manifest computed from it stays right across
        the retries). A job that has ended for good needs its credentials no more: its
        record is only redacted, no file is written. Idempotent: two daemons running it at
        once write the same file and the same record. Returns the ids migrated."""
        migrated: list[str] = []
        every_id = jobs.ids_by_status(states.ALL_STATES)
        for start in range(0, len(every_id), batch):
            for record in jobs.get_many(every_id[start : start + batch]):
                if record.secrets or not inline_credentials(record.manifest):
                    continue
                ended = states.is_terminal(record.status)
                if ended:
                    kept = redacted(record.manifest)
                else:
                    kept = self.extract(record.job_id, record.manifest) or record.manifest
                updated = jobs.update_fields(
                    record.job_id, manifest=kept, secrets="" if ended else SECRETS_IN_FILE
                )
                if states.is_terminal(updated.status) and not ended:
                    # It ended meanwhile, and its end removed the file it had not yet:
                    # nothing will remove the one written here.
                    self.remove(record.job_id)
                migrated.append(record.job_id)
                log.info(
                    "job %s: moved its inline data-store credentials out of its record%s",
                    record.job_id,
                    " (ended: redacted only)" if ended else f" into {self.path(record.job_id)}",
                )
        return migrated

    def remove(self, job_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(job_id).unlink()

    def _write(self, path: Path, values: dict[str, Any]) -> None:
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.root, 0o700)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump(values, fh)
            os.replace(tmp, path)
        except OSError as exc:
            raise JobSecretsError(f"cannot keep the job's data-store credentials: {exc}") from exc


def redacted(manifest: dict[str, Any]) -> dict[str, Any]:
    """`manifest` with every data-store connection value replaced by `***` (names kept)."""
    kept = dict(manifest)
    kept["data_stores"] = [
        {**ds, "connection": dict.fromkeys(ds["connection"], REDACTED)}
        if ds.get("connection")
        else dict(ds)
        for ds in manifest.get("data_stores") or []
    ]
    return kept


def inline_credentials(manifest: dict[str, Any]) -> bool:
    """Whether `manifest` holds a data-store connection value that is not redacted."""
    return any(
        value != REDACTED
        for ds in manifest.get("data_stores") or []
        for value in (ds.get("connection") or {}).values()
    )
