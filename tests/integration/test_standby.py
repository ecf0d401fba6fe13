"""Hot standby (`rhizomed --standby`, issue #18): a second daemon on the same platform
refuses the API until the active daemon dies, then takes over: the client that lists
both daemons carries on, no job is lost, the running job's guardian and learner go on
untouched (re-adopted, not restarted), and new jobs are scheduled and deployed by the
new leader. Real etcd, MongoDB-wire server, daemons and learners (local backend)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from rhizome.v1 import job_pb2, scheduler_pb2, scheduler_pb2_grpc

from contract import etcd_keys, procs
from contract.credentials import with_bearer
from contract.etcd import EtcdClient
from contract.procs import free_port
from services.client.sdk import Client, ClientError
from services.embedded.platform import DaemonServer
from services.embedded.process import ManagedServer
from services.embedded.standby import StandbyDaemonServer
from services.security.internal import SharedSecretCredentials
from services.store import states
from services.store.jobs import JobsRepository
from services.store.mongo import connect
from tests.integration.conftest import mint_token
from tests.services.guardian.helpers import wait_for

pytestmark = pytest.mark.integration

LONG = "name: standby-{n}\nmemory: 64MiB\nframework:\n  command: 'sleep 100000'\n"


def _holder_pid(etcd: EtcdClient, key: str) -> int:
    entry = etcd.get(key)
    if entry is None or not isinstance(entry.value, dict):
        return 0
    value = entry.value
    return int(value["pid"]) if procs.ref_alive(value.get("pid"), value.get("start")) else 0


def test_sigkill_of_the_active_daemon_the_standby_serves_and_no_job_is_lost(
    etcd_server: ManagedServer, mongo_server: ManagedServer, tmp_path: Path
) -> None:
    db_url = mongo_server.url.replace("/?", "/standby_takeover?")
    args = [
        f"--mongodb-uri={db_url}",
        f"--etcd={etcd_server.url}",
        "--services=api,scheduler,lcm",
        f"--admin-token-file={tmp_path / 'admin'}",
        "--leader-lease-ttl=3",
    ]
    active = DaemonServer(tmp_path, free_port(), free_port(), args)
    standby = StandbyDaemonServer(tmp_path, free_port(), free_port(), args)
    active.start_timeout_s = standby.start_timeout_s = 60
    active.start()
    db = connect(db_url)
    etcd = EtcdClient.connect(etcd_server.url)
    token = mint_token(db_url, "ha")
    try:
        standby.start()
        repo = JobsRepository(db)
        rz = Client(f"{active.url},{standby.url}", token=token, tls=False)
        running = rz.create_job(LONG.format(n=1)).job_id
        wait_for("the job to run", lambda: repo.get(running).status == states.PROCESSING)
        # The leader's lease has the TTL asked for (--leader-lease-ttl).
        (held,) = etcd.get_prefix(etcd_keys.leader("daemon/standby_takeover/")).values()
        assert etcd.raw.get_lease_info(held.lease).grantedTTL == 3
        guardian = wait_for(
            "its guardian", lambda: _holder_pid(etcd, etcd_keys.guardian_lease(running))
        )
        learner = wait_for(
            "its learner", lambda: _holder_pid(etcd, etcd_keys.learner_status(running, 0))
        )

        # The standby refuses the API while the active daemon lives, on gRPC and REST.
        with (
            Client(standby.url, token=token, tls=False) as direct,
            pytest.raises(ClientError) as refused,
        ):
            direct.get_job(running)
        assert refused.value.code == "UNAVAILABLE" and "standby" in refused.value.message
        rest = httpx.get(
            f"http://127.0.0.1:{standby.rest_port}/v1/models",
            headers={"Authorization": f"Bearer {token}"},
        )
        assert rest.status_code == 503 and "standby" in rest.json()["message"]

        # Learners were given the active daemon's internal port (remembered in the data
        # directory); the standby took another.
        old_internal = int((tmp_path / "internal.port").read_text())
        assert active.pid is not None and active.proc is not None
        os.kill(active.pid, signal.SIGKILL)
        active.proc.wait(timeout=10)

        # The same client, unchanged: its next calls reach the new leader.
        assert job_pb2.JobStatus.Name(rz.get_job(running).status) == states.PROCESSING
        after = rz.create_job(LONG.format(n=2)).job_id
        wait_for("the new job to run", lambda: repo.get(after).status == states.PROCESSING)
        assert {running, after} <= {j.job_id for j in rz.list_jobs().jobs}

        # The running job went on: the same guardian and learner, adopted, not restarted.
        assert _holder_pid(etcd, etcd_keys.guardian_lease(running)) == guardian
        assert _holder_pid(etcd, etcd_keys.learner_status(running, 0)) == learner
        statuses = [h.status for h in repo.get(running).history]
        assert statuses.count(states.DEPLOYING) == 1, statuses

        # The new leader serves the dead one's internal port too: running learners keep
        # the address they were given at deploy.
        token = SharedSecretCredentials.from_file(tmp_path / "internal.secret").service_token()
        with grpc.insecure_channel(f"127.0.0.1:{old_internal}") as raw:
            view = scheduler_pb2_grpc.SchedulerStub(with_bearer(raw, token)).GetCluster(
                scheduler_pb2.GetClusterRequest(), timeout=10
            )
        assert view.nodes

        # The new leader controls it: halting it goes through its guardian.
        rz.halt_job(running)
        wait_for("the halt", lambda: repo.get(running).status == states.HALTED)
        rz.delete_job(after)
        wait_for("the delete", lambda: repo.get(after).status == states.DELETED)
        rz.close()
    finally:
        standby.stop(timeout_s=30)
        active.stop(timeout_s=10)
        etcd.close()
        db.client.close()


def test_a_standby_with_nothing_to_stand_by_for_refuses_to_start_saying_why(
    etcd_server: ManagedServer, mongo_server: ManagedServer, tmp_path: Path
) -> None:
    # An API-only daemon has no leader-only service: a standby of it would wait for ever.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.daemon",
            "--standby",
            "--services=api",
            f"--mongodb-uri={mongo_server.url.replace('/?', '/standby_refused?')}",
            f"--etcd={etcd_server.url}",
            f"--grpc-address=127.0.0.1:{free_port()}",
            f"--rest-address=127.0.0.1:{free_port()}",
            f"--data-dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "--standby needs etcd (--etcd URL) and a service only one daemon may run" in (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr
