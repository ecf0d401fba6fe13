"""`rhizome inject --job`: the injector follows a job's current learners, against a real
daemon (API + LCM, guardians and learner controllers as processes) over the real etcd and
MongoDB-wire servers."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from contract import etcd_keys, procs
from contract.env import Role
from contract.etcd import EtcdClient
from services.client.sdk import Client
from services.daemon import Daemon
from services.embedded.process import ManagedServer
from services.injector.cli import inject
from services.injector.injector import Injector
from services.injector.targets import JobTargets
from tests.daemons import running_daemon
from tests.integration.conftest import token_client

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
TRACE = REPO / "tests" / "learner" / "checkpoint" / "fixtures" / "one-removal.csv"
MANIFEST = "name: inject-follow\nmemory: 256MiB\nmax_learner_restarts: 5\nframework:\n  command: 'sleep 100000'\n"


@pytest.fixture(scope="module")
def daemon(
    etcd_server: ManagedServer,
    mongo_server: ManagedServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Daemon]:
    with running_daemon(
        Path(tmp_path_factory.mktemp("inject")),
        mongo_server,
        database="inject_job",
        etcd=etcd_server,
        services=("api", "lcm"),
    ) as running:
        yield running


def until(probe: Callable[[], object], what: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if probe():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def job(daemon: Daemon, etcd_server: ManagedServer) -> Iterator[tuple[str, EtcdClient]]:
    client: Client = token_client(daemon, "alice")
    etcd = EtcdClient.connect(etcd_server.url)
    job_id = client.create_job(MANIFEST).job_id
    try:
        until(lambda: JobTargets(etcd, job_id).current(), "the job's learner to run")
        yield job_id, etcd
    finally:
        client.delete_job(job_id)
        until(lambda: not procs.labelled(job_id), "the job's processes to end")
        client.close()
        etcd.close()


def test_a_restarted_learner_still_receives_the_next_preemption(
    job: tuple[str, EtcdClient], tmp_path: Path
) -> None:
    job_id, etcd = job
    first_pids = procs.labelled(job_id, 0, Role.LEARNER)
    # A preemption every 0.2 s; those that find no running learner (it is being
    # restarted) are recorded as missed. Stop after two were delivered.
    injector = Injector(
        JobTargets(etcd, job_id),
        [0.2 * k for k in range(600)],
        notice_s=2.0,
        log_path=tmp_path / "inj.jsonl",
    )

    def stop_after_two() -> None:
        until(
            lambda: sum(i.outcome != "missed" for i in injector.injections) >= 2,
            "two delivered preemptions",
        )
        injector.stop()

    stopper = threading.Thread(target=stop_after_two, daemon=True)
    stopper.start()
    done = [i for i in injector.run() if i.outcome != "missed"]
    stopper.join()
    first, second = done[0], done[1]
    assert first.rank == 0 and second.rank == 0
    assert set(first.pids) == set(first_pids)
    assert not set(first.pids) & set(second.pids)  # the restarted incarnation's processes
    assert first.events[0] == "sigterm" and first.outcome in ("exited", "killed")
    assert second.events[0] == "sigterm" and second.outcome in ("exited", "killed")
    # the guardian restarted the preempted learner, counting it as a preemption (its own
    # counter, not max_learner_restarts': services/guardian/guardian.py PREEMPTIONS)
    preemptions = etcd.get(etcd_keys.deploy_step(job_id, "preemptions"))
    assert preemptions is not None and int(preemptions.value["0"]) >= 1


def test_cli_preempts_the_job_and_reports_the_rank(
    job: tuple[str, EtcdClient], etcd_server: ManagedServer
) -> None:
    job_id, _ = job
    result = CliRunner().invoke(
        inject,
        ["--job", job_id, "--etcd", etcd_server.url, "--mttp", "0.01", "--notice", "5", "--json"],
    )
    assert result.exit_code == 0, result.output
    assert '"rank": 0' in result.output and '"outcome": "exited"' in result.output


def test_cli_errors_name_the_problem(etcd_server: ManagedServer, tmp_path: Path) -> None:
    runner = CliRunner()
    url = etcd_server.url
    unknown = runner.invoke(inject, ["--job", "no-such-job", "--etcd", url, "--mttp", "5"])
    assert unknown.exit_code == 2 and "not running on this platform" in unknown.output
    assert "Traceback" not in unknown.output

    # A job whose only learner finished, its guardian gone: nothing left to preempt.
    ended = f"ended-{uuid.uuid4().hex[:6]}"
    etcd = EtcdClient.connect(url)
    try:
        etcd.put(etcd_keys.learner_status(ended, 0), {"status": "COMPLETED"})
        done = runner.invoke(inject, ["--job", ended, "--etcd", url, "--trace", str(TRACE)])
    finally:
        etcd.delete_prefix(etcd_keys.job_prefix(ended))
        etcd.close()
    assert done.exit_code == 2 and "is not running (learners: 0=COMPLETED)" in done.output

    bad = tmp_path / "bad.csv"
    bad.write_text("this is, not a trace\n")
    trace = runner.invoke(inject, ["--job", "j", "--etcd", url, "--trace", str(bad)])
    assert trace.exit_code == 2 and "Traceback" not in trace.output

    both = runner.invoke(inject, ["--job", "j", "--pid", "1", "--mttp", "5"])
    assert both.exit_code == 2 and "not both or neither" in both.output
    no_etcd = runner.invoke(
        inject,
        ["--job", "j", "--mttp", "5", "--data-dir", str(tmp_path / "none")],
        env={"RHIZOME_ETCD": ""},
    )
    assert no_etcd.exit_code == 2 and "--etcd URL" in no_etcd.output
    assert "no embedded platform in" in no_etcd.output
