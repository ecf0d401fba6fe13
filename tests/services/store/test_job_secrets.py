"""Data-store credentials kept beside, not in, the job record
(services/store/job_secrets.py): moved out at submit, resolved at deploy, removed at the
end (file-system only; the record side is tested through the real platform in
tests/integration/test_security_platform.py); and the migration of records that still
hold them inline, against the real MongoDB-wire server."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.store import states
from services.store.job_secrets import SECRETS_IN_FILE, JobSecrets, JobSecretsError
from services.store.jobs import JobRecord, JobsRepository, new_job_id
from services.store.mongo import connect

MANIFEST: dict[str, Any] = {
    "name": "x",
    "framework": {"command": "true"},
    "data_stores": [
        {"id": "bucket", "type": "s3_datastore", "connection": {"password": "pw-1", "key": 7}},
        {"id": "plain", "type": "local"},
    ],
}


def test_values_move_to_a_0600_file_and_the_record_keeps_names(tmp_path: Path) -> None:
    store = JobSecrets.in_data_dir(tmp_path)
    kept = store.extract("job-1", MANIFEST)
    assert kept is not None
    assert kept["data_stores"][0]["connection"] == {"password": "***", "key": "***"}
    assert kept["data_stores"][1] == MANIFEST["data_stores"][1]
    assert "pw-1" not in repr(kept)
    path = store.path("job-1")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    resolved = store.resolve("job-1", kept)
    assert resolved["data_stores"][0]["connection"] == {"password": "pw-1", "key": 7}
    store.remove("job-1")
    assert not path.exists()
    store.remove("job-1")  # idempotent


def test_a_manifest_without_connection_values_keeps_no_file(tmp_path: Path) -> None:
    store = JobSecrets.in_data_dir(tmp_path)
    assert store.extract("job-2", {"name": "x", "framework": {"command": "true"}}) is None
    assert not store.path("job-2").exists()


def test_a_missing_file_is_named_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(JobSecretsError, match="--data-dir"):
        JobSecrets.in_data_dir(tmp_path).resolve("job-3", MANIFEST)


def test_a_job_id_cannot_name_a_path_outside(tmp_path: Path) -> None:
    with pytest.raises(JobSecretsError):
        JobSecrets.in_data_dir(tmp_path).path("../etc/passwd")


# -- records written before the store existed: migrated on daemon start -----------------


@pytest.fixture
def legacy_jobs(mongo_server: Any) -> Iterator[JobsRepository]:
    """A repository as an older daemon had it: no secret store, credentials inline."""
    db = connect(mongo_server.url)
    repo = JobsRepository(db)
    repo.ensure_indexes()
    yield repo
    db.client.close()


def legacy_record() -> JobRecord:
    return JobRecord(
        job_id=new_job_id(), owner="alice", name="x", manifest=dict(MANIFEST), resources={}
    )


def test_inline_credentials_move_to_the_file_and_out_of_the_record(
    tmp_path: Path, legacy_jobs: JobsRepository
) -> None:
    running, _ = legacy_jobs.create(legacy_record())
    ended, _ = legacy_jobs.create(legacy_record())
    legacy_jobs.transition(ended.job_id, states.DELETED, "deleted")
    assert legacy_jobs.get(running.job_id).manifest["data_stores"][0]["connection"]["password"]
    store = JobSecrets.in_data_dir(tmp_path)

    migrated = store.migrate_inline(legacy_jobs, batch=1)

    assert {running.job_id, ended.job_id} <= set(migrated)
    record = legacy_jobs.get(running.job_id)
    assert "pw-1" not in repr(record.manifest)
    assert record.secrets == SECRETS_IN_FILE
    assert stat.S_IMODE(store.path(running.job_id).stat().st_mode) == 0o600
    resolved = store.resolve(running.job_id, record.manifest)
    assert resolved["data_stores"][0]["connection"] == {"password": "pw-1", "key": 7}
    # An ended job needs them no more: redacted, and no file left behind.
    gone = legacy_jobs.get(ended.job_id)
    assert "pw-1" not in repr(gone.manifest) and not store.path(ended.job_id).exists()
    # A second start finds nothing left to move.
    assert not {running.job_id, ended.job_id} & set(store.migrate_inline(legacy_jobs))


def test_a_concurrent_writer_loses_nothing(
    tmp_path: Path, legacy_jobs: JobsRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, _ = legacy_jobs.create(legacy_record())
    update_fields = legacy_jobs.update_fields
    raced: list[str] = []

    def racing_update_fields(job_id: str, **fields: Any) -> JobRecord:
        # Another daemon's scheduler places the job between the migration's read of the
        # record and its write.
        if job_id == job.job_id and not raced:
            raced.append(job_id)
            legacy_jobs.transition(job_id, states.PENDING, "placed", placement={"node": "n1"})
        return update_fields(job_id, **fields)

    monkeypatch.setattr(legacy_jobs, "update_fields", racing_update_fields)
    JobSecrets.in_data_dir(tmp_path).migrate_inline(legacy_jobs)

    record = legacy_jobs.get(job.job_id)
    assert raced and record.status == states.PENDING and record.placement == {"node": "n1"}
    assert "pw-1" not in repr(record.manifest) and record.secrets == SECRETS_IN_FILE
    assert [h.status for h in record.history] == [states.QUEUED, states.PENDING]
