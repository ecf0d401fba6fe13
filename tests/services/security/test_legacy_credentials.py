"""A daemon started over job records an older version wrote, with data-store credentials
inline, moves them out of MongoDB once it leads and says so in its log (issue #15;
services/store/job_secrets.py `migrate_inline`, called from services/daemon.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.procs import free_port
from services.embedded.platform import DaemonServer
from services.embedded.process import ManagedServer
from services.store.job_secrets import SECRETS_IN_FILE, JobSecrets
from services.store.jobs import JobRecord, JobsRepository, new_job_id
from services.store.mongo import connect
from tests.services.guardian.helpers import wait_for

pytestmark = pytest.mark.integration

LEGACY_MANIFEST = {
    "name": "legacy",
    "framework": {"command": "true"},
    "data_stores": [
        {"id": "bucket", "type": "s3_datastore", "connection": {"password": "old-pw"}},
    ],
}


def test_a_started_daemon_moves_inline_credentials_out_of_old_records(
    mongo_server: ManagedServer, tmp_path: Path
) -> None:
    db_url = mongo_server.url.replace("/?", "/legacy_credentials?")
    db = connect(db_url)
    try:
        old = JobsRepository(db)  # as an older daemon stored a submit: inline
        old.ensure_indexes()
        job, _ = old.create(
            JobRecord(
                job_id=new_job_id(),
                owner="alice",
                name="legacy",
                manifest=LEGACY_MANIFEST,
                resources={},
            )
        )
        assert "old-pw" in repr(old.get(job.job_id).manifest)
        daemon = DaemonServer(
            tmp_path,
            free_port(),
            free_port(),
            [
                f"--mongodb-uri={db_url}",
                "--services=api",
                "--metrics-address=",
                f"--admin-token-file={tmp_path / 'admin'}",
            ],
        )
        daemon.start()
        try:
            # In the background, once the daemon leads (it must not delay serving).
            def migrated() -> JobRecord | None:
                record = old.get(job.job_id)
                return record if record.secrets == SECRETS_IN_FILE else None

            def logged() -> str | None:
                text = daemon.log_path.read_text()
                return text if "moved the inline" in text else None

            record = wait_for(
                "the record to be migrated",
                migrated,
                explain=lambda: daemon.log_path.read_text()[-2000:],
            )
            assert "old-pw" not in repr(record.manifest)
            secrets = JobSecrets.in_data_dir(tmp_path)
            resolved = secrets.resolve(job.job_id, record.manifest)
            assert resolved["data_stores"][0]["connection"] == {"password": "old-pw"}
            log = wait_for("the daemon to log the migration", logged)
            assert "moved the inline data-store credentials of 1 job record" in log
            assert job.job_id in log and "old-pw" not in log
        finally:
            daemon.stop()
    finally:
        db.client.close()
