"""The scheduler hosted by the daemon: submit-time admission, gang placement into
PENDING, explanations for waiting jobs, release when a job ends, restart without
double-booking. Real MongoDB-wire server; no LCM, so placed jobs stay PENDING."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from rhizome.v1 import job_pb2

from services.client.sdk import ClientError
from services.daemon import Daemon
from services.embedded.process import ManagedServer
from services.scheduler.api import QuotaConfigError
from tests.daemons import own_database, start_daemon
from tests.integration.conftest import token_client, wait_job_status

pytestmark = pytest.mark.integration

GPU_JOB = "name: {name}\nlearners: 2\ngpus: 2\ngpu_type: FAKE\ncpus: 1\nmemory: 512\nframework: {{command: 'true'}}\n"


def scheduling_daemon(mongo: ManagedServer, data_dir: Path, quota_config: str = "") -> Daemon:
    # A database of its own per test: reservations are cluster-wide, and other tests'
    # queued jobs must not compete for this cluster.
    return start_daemon(
        data_dir,
        mongo,
        database=own_database(data_dir),
        services=("api", "scheduler"),
        quota_config=quota_config,
    )


@pytest.fixture()
def daemon(mongo_server: ManagedServer, tmp_path: Path) -> Iterator[Daemon]:
    d = scheduling_daemon(mongo_server, tmp_path)
    try:
        yield d
    finally:
        d.stop()


def test_gangs_are_placed_whole_and_a_waiting_job_says_why(
    daemon: Daemon, mongo_server: ManagedServer, tmp_path: Path
) -> None:
    with token_client(daemon, f"s-{uuid.uuid4().hex[:6]}") as rz:
        first = rz.create_job(GPU_JOB.format(name="first")).job_id
        placed = wait_job_status(rz, first, job_pb2.PENDING)
        nodes = dict(placed.placement.learner_nodes)
        assert sorted(nodes) == [0, 1] and all(
            n.startswith("local-fakegpu") for n in nodes.values()
        )
        second = rz.create_job(GPU_JOB.format(name="second")).job_id
        deadline = time.monotonic() + 10
        while not rz.get_job(second).queue_reason and time.monotonic() < deadline:
            time.sleep(0.1)
        waiting = rz.get_job(second)
        assert waiting.status == job_pb2.QUEUED
        assert "needs 2 learners × 2 FAKE" in waiting.queue_reason
        # Deleting the first frees its GPUs, and the second gets them.
        rz.delete_job(first)
        wait_job_status(rz, second, job_pb2.PENDING)
        rz.delete_job(second)


def test_a_resumed_job_is_queued_and_placed_by_the_scheduler_like_a_new_one(
    daemon: Daemon,
) -> None:
    with token_client(daemon, f"s-{uuid.uuid4().hex[:6]}") as rz:
        first = rz.create_job(GPU_JOB.format(name="first")).job_id
        wait_job_status(rz, first, job_pb2.PENDING)
        rz.halt_job(first)  # releases its GPUs
        second = rz.create_job(GPU_JOB.format(name="second")).job_id
        wait_job_status(rz, second, job_pb2.PENDING)
        # Resumed, the first waits for the GPUs the second now holds, instead of being
        # redeployed on its old nodes outside the scheduler's view.
        assert rz.resume_job(first).status == job_pb2.QUEUED
        deadline = time.monotonic() + 10
        while not rz.get_job(first).queue_reason and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "needs 2 learners × 2 FAKE" in rz.get_job(first).queue_reason
        rz.delete_job(second)
        placed = wait_job_status(rz, first, job_pb2.PENDING)
        assert sorted(dict(placed.placement.learner_nodes)) == [0, 1]
        rz.delete_job(first)


def test_a_job_larger_than_the_cluster_is_refused_at_submit(daemon: Daemon) -> None:
    with token_client(daemon, f"s-{uuid.uuid4().hex[:6]}") as rz:
        with pytest.raises(ClientError) as info:
            rz.create_job(GPU_JOB.format(name="huge").replace("learners: 2", "learners: 3"))
        assert info.value.code == "INVALID_ARGUMENT"
        assert "can never run on this cluster" in info.value.message
        with pytest.raises(ClientError, match=r"unknown GPU type .H900.; the cluster has FAKE"):
            rz.create_job(GPU_JOB.format(name="odd").replace("FAKE", "H900"))
        assert list(rz.iter_jobs()) == []


def test_a_restarted_scheduler_keeps_its_reservations(
    mongo_server: ManagedServer, tmp_path: Path
) -> None:
    user = f"s-{uuid.uuid4().hex[:6]}"
    d1 = scheduling_daemon(mongo_server, tmp_path)
    try:
        with token_client(d1, user) as rz:
            first = rz.create_job(GPU_JOB.format(name="keep")).job_id
            wait_job_status(rz, first, job_pb2.PENDING)
    finally:
        d1.stop()
    d2 = scheduling_daemon(mongo_server, tmp_path)
    try:
        with token_client(d2, user) as rz:
            second = rz.create_job(GPU_JOB.format(name="after-restart")).job_id
            time.sleep(1.5)  # several scheduling passes
            # The restored reservation still holds the FAKE GPUs: no double-booking.
            assert rz.get_job(second).status == job_pb2.QUEUED
            rz.delete_job(first)
            wait_job_status(rz, second, job_pb2.PENDING)
            rz.delete_job(second)
    finally:
        d2.stop()


QUOTAS = """borrowing: true
default: {quota: {}, limit: {FAKE: 4}}
users:
  owner-a: {quota: {FAKE: 4}, limit: {FAKE: 4}}
"""


def test_a_borrowing_job_is_halted_when_the_quota_owner_needs_it(
    mongo_server: ManagedServer, tmp_path: Path
) -> None:
    (tmp_path / "quotas.yaml").write_text(QUOTAS)
    d = scheduling_daemon(mongo_server, tmp_path, quota_config=str(tmp_path / "quotas.yaml"))
    try:
        with (
            token_client(d, "borrower") as b,
            token_client(d, "owner-a") as a,
        ):
            borrowed = b.create_job(GPU_JOB.format(name="borrows")).job_id
            wait_job_status(b, borrowed, job_pb2.PENDING)  # all 4 FAKE GPUs, borrowed
            owned = a.create_job(GPU_JOB.format(name="owns")).job_id
            wait_job_status(a, owned, job_pb2.PENDING)
            halted = wait_job_status(b, borrowed, job_pb2.HALTED)
            assert "quota it borrowed" in halted.status_message
            a.delete_job(owned)
            b.delete_job(borrowed)
    finally:
        d.stop()


def test_a_quota_config_with_a_typo_stops_the_daemon_with_the_reason(
    mongo_server: ManagedServer, tmp_path: Path
) -> None:
    (tmp_path / "quotas.yaml").write_text("borowing: true\n")
    with pytest.raises(QuotaConfigError, match="borowing"):
        scheduling_daemon(mongo_server, tmp_path, quota_config=str(tmp_path / "quotas.yaml"))
