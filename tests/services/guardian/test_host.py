"""Guardian hosts (services/guardian/host.py): the guardians of several jobs in one
process, against real etcd and a real MongoDB-wire server."""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from contract import etcd_keys
from services.backends.api import get_backend
from services.guardian.config import GuardianConfig
from services.guardian.guardian import EXIT_ALREADY_GUARDED, EXIT_TERMINATED
from services.guardian.host import (
    GuardianHost,
    HostConfig,
    HostedGuardian,
    JobLogHandler,
    assignment,
    working_for,
)
from services.store import states
from tests.services.guardian.helpers import history, job_report, start_guardian, submit, wait_for

pytestmark = pytest.mark.integration

# A learner that runs until the test lets it finish (a file next to its job directory).
WAIT_FOR_GO = "touch ../ready\nwhile [ ! -e ../go ]; do sleep 0.1; done\n"


@pytest.fixture
def hosts(stores: dict[str, Any], tmp_path: Path) -> Iterator[Any]:
    """Starts `python -m services.guardian.host` processes; any left are killed after."""
    started: list[subprocess.Popen[bytes]] = []

    def start(host_id: str, *jobs: str, assigned: bool = False) -> subprocess.Popen[bytes]:
        argv = [
            sys.executable,
            "-m",
            "services.guardian.host",
            f"--host-id={host_id}",
            f"--etcd={stores['etcd_url']}",
            f"--mongodb-uri={stores['mongo_url']}",
            f"--data-dir={tmp_path}",
            "--poll=0.5",
        ] + [f"--job={j}" for j in jobs]
        log = open(tmp_path / f"host-{host_id}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if assigned else subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def held_by(stores: dict[str, Any], job_id: str, host_id: str, status: str = "") -> bool:
    """Whether host `host_id` holds the job's guardian key (and the job is at `status`)."""
    if status and stores["repo"].get(job_id).status != status:
        return False
    return bool(holder(stores, job_id).get("host") == host_id)


def holder(stores: dict[str, Any], job_id: str) -> dict[str, Any]:
    entry = stores["etcd"].get(etcd_keys.guardian_lease(job_id))
    return entry.value if entry is not None else {}


def delete(stores: dict[str, Any], job_id: str) -> None:
    stores["etcd"].put(etcd_keys.control(job_id), {"action": "delete", "reason": "test over"})


def explain(stores: dict[str, Any], tmp_path: Path, job_ids: list[str]) -> Any:
    def report() -> str:
        logs = "\n".join(
            f"{p.name}:\n{p.read_text(errors='replace')[-3000:]}" for p in tmp_path.glob("host-*")
        )
        return "\n".join(job_report(stores["repo"], j, tmp_path) for j in job_ids) + "\n" + logs

    return report


def test_one_host_deploys_and_completes_several_jobs(
    stores: dict[str, Any], tmp_path: Path, hosts: Any
) -> None:
    script = 'echo "rank=$RANK world=$WORLD_SIZE"\n'
    jobs = [
        submit(stores["repo"], tmp_path, "sh run.sh", learners=learners, files={"run.sh": script})
        for learners in (1, 2, 1)
    ]
    ids = [j.job_id for j in jobs]
    host = hosts("h1", *ids)
    assert host.wait(timeout=60) == 0, explain(stores, tmp_path, ids)()
    for job in jobs:
        assert stores["repo"].get(job.job_id).status == states.COMPLETED
        assert history(stores["repo"], job.job_id) == [
            "QUEUED", "PENDING", "DEPLOYING", "DOWNLOADING", "PROCESSING", "STORING", "COMPLETED",
        ]  # fmt: skip
        out = (tmp_path / "jobs" / job.job_id / "learners" / "0" / "stdout.log").read_text()
        assert "rank=0 world=" in out
        assert stores["etcd"].get_prefix(etcd_keys.job_prefix(job.job_id)) == {}
    log = (tmp_path / "host-h1.log").read_text()
    assert log.count("guarded in host h1") == 3  # all three guardians in this one process


def test_a_killed_host_s_jobs_are_adopted_by_a_new_host_and_none_is_lost(
    stores: dict[str, Any], tmp_path: Path, hosts: Any
) -> None:
    jobs = [
        submit(stores["repo"], tmp_path, "sh run.sh", files={"run.sh": WAIT_FOR_GO})
        for _ in range(2)
    ]
    ids = [j.job_id for j in jobs]
    why = explain(stores, tmp_path, ids)
    first = hosts("h1", assigned=True)  # given its jobs on its standard input, as the LCM does
    assert first.stdin is not None
    for job_id in ids:
        first.stdin.write(assignment(job_id, {}).encode())
    first.stdin.flush()
    try:
        for job_id in ids:
            wait_for(
                f"{job_id} PROCESSING under h1",
                functools.partial(held_by, stores, job_id, "h1", states.PROCESSING),
                explain=why,
            )
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        second = hosts("h2", *ids)
        for job_id in ids:
            wait_for(
                f"{job_id} re-adopted by h2",
                functools.partial(held_by, stores, job_id, "h2"),
                explain=why,
            )
        for job_id in ids:
            (tmp_path / "jobs" / job_id / "go").touch()
        assert second.wait(timeout=60) == 0, why()
    finally:
        for job_id in ids:
            if stores["repo"].get(job_id).status not in states.TERMINAL_STATES:
                delete(stores, job_id)
    for job_id in ids:
        assert stores["repo"].get(job_id).status == states.COMPLETED, why()
        # resumed from its steps in etcd: deployed once, not again
        assert history(stores["repo"], job_id).count("DEPLOYING") == 1


def test_a_second_guardian_for_a_job_a_host_holds_is_fenced_out(
    stores: dict[str, Any], tmp_path: Path, hosts: Any
) -> None:
    job = submit(stores["repo"], tmp_path, "sh run.sh", files={"run.sh": WAIT_FOR_GO})
    why = explain(stores, tmp_path, [job.job_id])
    first = hosts("h1", job.job_id)
    try:
        wait_for("h1's key", lambda: holder(stores, job.job_id).get("host") == "h1", explain=why)
        # a guardian process, then another host: both find the key held and stay out
        alone = start_guardian(job.job_id, stores["etcd_url"], stores["mongo_url"], tmp_path)
        assert alone.wait(timeout=30) == EXIT_ALREADY_GUARDED
        second = hosts("h2", job.job_id)
        assert second.wait(timeout=30) == 0
        assert "already has a live guardian" in (tmp_path / "host-h2.log").read_text()
        assert holder(stores, job.job_id).get("host") == "h1"
    finally:
        delete(stores, job.job_id)
    assert first.wait(timeout=30) == 0, why()
    assert stores["repo"].get(job.job_id).status == states.DELETED


class _FailsOnce(HostedGuardian):
    """A guardian whose first step raises (a bug in one job's guardian)."""

    crashes = 0

    def step(self) -> int | None:
        if _FailsOnce.crashes == 0:
            _FailsOnce.crashes += 1
            raise RuntimeError("injected: a guardian's step failed")
        return super().step()


def test_a_guardian_whose_step_raises_is_restarted_inside_the_host(
    stores: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("services.guardian.host.HostedGuardian", _FailsOnce)
    _FailsOnce.crashes = 0
    jobs = [submit(stores["repo"], tmp_path, "simulated", env={"SIM_SECONDS": "0.2"})]
    jobs.append(submit(stores["repo"], tmp_path, "simulated", env={"SIM_SECONDS": "0.2"}))

    def make_config(job_id: str, env: dict[str, str]) -> GuardianConfig:
        return GuardianConfig(job_id, stores["etcd_url"], stores["mongo_url"], tmp_path)

    host = GuardianHost(
        HostConfig("in-process", poll_s=0.2),
        stores["etcd"],
        stores["repo"],
        get_backend("simulated"),
        make_config,
    ).start()
    for job in jobs:
        assert host.adopt(job.job_id)
    started = time.monotonic()
    while host.guardians and time.monotonic() - started < 30:
        host.tick()
        time.sleep(0.05)
    host.close()
    assert _FailsOnce.crashes == 1
    for job in jobs:  # the crash cost neither job: both ended as they should
        assert stores["repo"].get(job.job_id).status == states.COMPLETED
        assert host.ended[job.job_id] == 0


class _SlowSteps(HostedGuardian):
    """A guardian whose every step blocks until the test lets it go: the host's pools
    saturated, as by stuck backend calls or halts waiting out their grace period. The jobs
    in `deployed` pretend to be deployed, so their steps take the step pool (the others',
    the deploy pool)."""

    deployed: set[str] = set()
    let_go = threading.Event()
    blocked: list[str] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.job_id in self.deployed:
            self.watching = ("pretend", "deployed")  # type: ignore[assignment]

    def step(self) -> int | None:
        _SlowSteps.blocked.append(threading.current_thread().name)
        _SlowSteps.let_go.wait(120)
        return EXIT_TERMINATED


def test_a_host_whose_pools_are_saturated_keeps_its_lease(
    stores: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host's lease is refreshed from a thread of its own: with one step thread and one
    deploy thread both held by slow steps (and more jobs queued behind them), it is
    refreshed on and on, and every job's guardian key outlives several TTLs. A lease
    refreshed from the pools or the host's loop would lapse here after 2 s."""
    monkeypatch.setattr("services.guardian.host.HostedGuardian", _SlowSteps)
    jobs = [submit(stores["repo"], tmp_path, "simulated", place=False).job_id for _ in range(4)]
    _SlowSteps.deployed = set(jobs[:2])
    _SlowSteps.let_go = threading.Event()
    _SlowSteps.blocked = []

    def make_config(job_id: str, env: dict[str, str]) -> GuardianConfig:
        return GuardianConfig(job_id, stores["etcd_url"], stores["mongo_url"], tmp_path)

    ttl = 2  # etcd's shortest, so that the test waits out several of them quickly
    host = GuardianHost(
        HostConfig("busy", lease_ttl_s=ttl, poll_s=0.2, step_threads=1, deploy_threads=1),
        stores["etcd"],
        stores["repo"],
        get_backend("simulated"),
        make_config,
    ).start()
    assert host.lease is not None
    lease = host.lease
    refreshed_on: list[str] = []
    refresh = lease.refresh

    def recording() -> bool:
        refreshed_on.append(threading.current_thread().name)
        return refresh()

    monkeypatch.setattr(lease, "refresh", recording)
    try:
        for job_id in jobs:
            assert host.adopt(job_id)
        wait_for(
            "one slow step on each pool",
            lambda: sorted(n.split("_")[0] for n in _SlowSteps.blocked) == ["deploy", "step"],
        )
        saturated = len(refreshed_on)
        # 4 refreshes a TTL: 12 more is 3 TTLs with both pools held the whole time
        wait_for(
            "12 refreshes while the pools are held",
            lambda: len(refreshed_on) >= saturated + 12,
            explain=lambda: f"refreshes on {refreshed_on}",
        )
        assert len(_SlowSteps.blocked) == 2  # still held: the other jobs wait their turn
        assert not lease.lost.is_set()
        for job_id in jobs:
            entry = stores["etcd"].get(etcd_keys.guardian_lease(job_id))
            assert entry is not None and entry.lease == lease.id, job_id
        pools = {"step", "deploy", "MainThread"}
        assert refreshed_on and not {n.split("_")[0] for n in refreshed_on} & pools
    finally:
        _SlowSteps.let_go.set()
        host.close()


def test_a_hosted_guardian_s_lines_go_to_its_job_s_log_never_through_a_link(
    tmp_path: Path,
) -> None:
    """JobLogHandler: a line logged while working for a job lands in that job's
    guardian.log; a link a learner left there (a symlink, a hard link) is not written
    through; lines of no job's work stay out of every job's log."""
    jobs = tmp_path / "jobs"
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    (jobs / "job-linked").mkdir(parents=True)
    (jobs / "job-linked" / "guardian.log").symlink_to(victim)
    (jobs / "job-hard").mkdir(parents=True)
    os.link(victim, jobs / "job-hard" / "guardian.log")
    logger = logging.getLogger("test.job-log-handler")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = JobLogHandler(jobs, "h1")
    logger.addHandler(handler)
    try:
        logger.info("the host's own line")
        for job_id in ("job-ok", "job-linked", "job-hard"):
            with working_for(job_id):
                logger.info("deployed %s", job_id)
    finally:
        logger.removeHandler(handler)
    lines = (jobs / "job-ok" / "guardian.log").read_text().splitlines()
    assert len(lines) == 1 and lines[0].endswith("guardian[job-ok] host[h1]: deployed job-ok")
    assert victim.read_text() == "root's file\n"
    assert (jobs / "job-linked" / "guardian.log").is_symlink()
