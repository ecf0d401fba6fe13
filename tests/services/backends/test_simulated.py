"""The simulated backend (control-plane benchmarks) drives real jobs through the real
platform: API, scheduler, LCM, guardian, etcd and MongoDB, with learners that train
nothing. Its jobs must end as real ones do, with a legal history and their log lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.procs import free_port
from services.client.sdk import Client
from services.embedded.platform import DaemonServer
from services.embedded.process import ManagedServer
from services.store import states
from services.store.jobs import JobsRepository
from services.store.mongo import connect
from tests.integration.conftest import mint_token
from tests.services.guardian.helpers import wait_for

pytestmark = pytest.mark.integration

MANIFEST = (
    "name: sim-{n}\nlearners: 2\nmemory: 64MiB\nframework:\n  command: 'never run'\n"
    "env:\n  SIM_SECONDS: '{seconds}'\n  SIM_LOG_LINES: '3'\n"
)


def test_simulated_jobs_complete_and_halt_through_the_real_platform(
    etcd_server: ManagedServer,
    mongo_server: ManagedServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Simulated learners do not watch the halt request as a controller does: a halt
    # waits out the learners' grace (and the guardian's 5 s margin) before it ends
    # HALTED. The platform's 10 s grace made that 15 s of this test; 1 s is as good.
    monkeypatch.setenv("RHIZOME_LEARNER_GRACE_S", "1")
    db_url = mongo_server.url.replace("/?", "/simulated_backend?")
    daemon = DaemonServer(
        tmp_path,
        free_port(),
        free_port(),
        [
            f"--mongodb-uri={db_url}",
            f"--etcd={etcd_server.url}",
            "--services=api,scheduler,lcm",
            "--backend=simulated",
            f"--admin-token-file={tmp_path / 'admin'}",
        ],
    )
    daemon.start()
    db = connect(db_url)
    try:
        repo = JobsRepository(db)
        with Client(daemon.url, token=mint_token(db_url, "sim"), tls=False) as rz:
            done = rz.create_job(MANIFEST.format(n=1, seconds=0.5)).job_id
            halted = rz.create_job(MANIFEST.format(n=2, seconds=600)).job_id
            wait_for("the short job to complete", lambda: repo.get(done).status == states.COMPLETED)
            wait_for(
                "the long job to process",
                lambda: repo.get(halted).status == states.PROCESSING,
            )
            rz.halt_job(halted)
            wait_for("the long job to halt", lambda: repo.get(halted).status == states.HALTED)
        statuses = [h.status for h in repo.get(done).history]
        assert statuses == [
            states.QUEUED,
            states.PENDING,
            states.DEPLOYING,
            states.DOWNLOADING,
            states.PROCESSING,
            states.STORING,
            states.COMPLETED,
        ]
        for rank in (0, 1):
            out = tmp_path / "jobs" / done / "learners" / str(rank) / "stdout.log"
            assert out.read_text().splitlines() == [
                "step 1 loss 1.0000",
                "step 2 loss 0.5000",
                "step 3 loss 0.3333",
            ]
    finally:
        db.client.close()
        daemon.stop()
