"""Data-store credentials kept beside, not in, the job record
(services/store/job_secrets.py): moved out at submit, resolved at deploy, removed at the
end. File-system only; the record side is tested through the real platform in
tests/integration/test_security_platform.py."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from services.store.job_secrets import JobSecrets, JobSecretsError

MANIFEST = {
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
