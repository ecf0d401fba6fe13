"""A daemon SIGKILLed while clients submit loses no acknowledged job and leaves no partial one.

Submits are group-committed (services/store/group_commit.py): a caller is acknowledged
only after the ``insert_many`` that carried its document returned. Killing the daemon at a
random moment of a submit storm must therefore leave every acknowledged job stored, whole
(QUEUED with its history, code and digest), and nothing else half-written.
"""

from __future__ import annotations

import io
import threading
import zipfile
from pathlib import Path

import pytest

from contract.procs import free_port
from services.client.sdk import Client, ClientError
from services.embedded.platform import DaemonServer
from services.embedded.process import ManagedServer
from services.store import states
from services.store.jobs import JobsRepository
from services.store.mongo import connect
from tests.integration.conftest import mint_token

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

MANIFEST = "name: storm-{n}\nlearners: 1\nmemory: 256MiB\nframework:\n  command: 'true'\n"
CLIENTS = 8
ACKS_BEFORE_KILL = 150


def _archive() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("train.py", "print('hi')\n")
    return buf.getvalue()


def test_sigkill_during_a_submit_storm_loses_no_acknowledged_job(
    mongo_server: ManagedServer, tmp_path: Path
) -> None:
    db_url = mongo_server.url.replace("/?", "/submit_crash?")
    token = mint_token(db_url, "storm")
    daemon = DaemonServer(
        tmp_path,
        free_port(),
        free_port(),
        [f"--mongodb-uri={db_url}", "--services=api", f"--admin-token-file={tmp_path / 'admin'}"],
    )
    daemon.start()
    acked: list[str] = []
    lock = threading.Lock()
    enough = threading.Event()
    code = _archive()

    def storm(worker: int) -> None:
        with Client(daemon.url, token=token, tls=False, timeout_s=10) as rz:
            n = 0
            while True:
                n += 1
                try:
                    job_id = rz.create_job(MANIFEST.format(n=f"{worker}-{n}"), code).job_id
                except ClientError:
                    return  # the daemon is gone: this submit was never acknowledged
                with lock:
                    acked.append(job_id)
                    if len(acked) >= ACKS_BEFORE_KILL:
                        enough.set()

    threads = [threading.Thread(target=storm, args=(w,), daemon=True) for w in range(CLIENTS)]
    try:
        for t in threads:
            t.start()
        assert enough.wait(120), f"only {len(acked)} submits acknowledged in 120 s"
        assert daemon.pid is not None
        daemon.kill(whole_group=False)  # mid-storm: batches are in flight
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads), "a client hung after the daemon died"
    finally:
        daemon.stop()

    db = connect(db_url)
    try:
        repo = JobsRepository(db)
        stored = {doc["_id"]: doc for doc in db["jobs"].find({"owner": "storm"})}
        missing = [job_id for job_id in acked if job_id not in stored]
        assert not missing, f"{len(missing)} acknowledged jobs lost, e.g. {missing[:3]}"
        objects = tmp_path / "objects" / "models"
        for job_id in stored:
            job = repo.get(job_id)
            assert job.status == states.QUEUED
            assert [h.status for h in job.history] == [states.QUEUED]
            assert job.manifest_digest and job.version == 1
            # the code is written before the record, so a stored job always has it
            assert (objects / f"{job_id}.zip").read_bytes() == code
    finally:
        db.client.close()
