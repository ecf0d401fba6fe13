"""The LCM with guardian hosts (`guardians_per_host`): jobs' guardians share host
processes, and a host's death costs no job."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from contract import etcd_keys, procs
from services.lcm.manager import LcmConfig, LifecycleManager
from services.store import states
from tests.services.guardian.helpers import history, job_report, submit, wait_for

pytestmark = pytest.mark.integration

WAIT_FOR_GO = "touch ../ready\nwhile [ ! -e ../go ]; do sleep 0.1; done\n"


@pytest.fixture
def lcm(stores: dict[str, Any], tmp_path: Path) -> Iterator[LifecycleManager]:
    config = LcmConfig(
        tmp_path, stores["etcd_url"], stores["mongo_url"], poll_s=0.1, guardians_per_host=2
    )
    manager = LifecycleManager(config, stores["repo"], stores["etcd"])
    manager.start()
    yield manager
    manager.stop()


def guardian_pid(stores: dict[str, Any], job_id: str) -> int:
    entry = stores["etcd"].get(etcd_keys.guardian_lease(job_id))
    return int(entry.value["pid"]) if entry is not None else 0


def test_jobs_share_hosts_and_a_killed_host_s_jobs_finish_under_a_new_one(
    stores: dict[str, Any], tmp_path: Path, lcm: LifecycleManager
) -> None:
    ids = [
        submit(
            stores["repo"], tmp_path, "sh run.sh", files={"run.sh": WAIT_FOR_GO}, place=False
        ).job_id
        for _ in range(3)
    ]

    def why() -> str:
        logs = [
            f"{p.name}:\n{p.read_text(errors='replace')[-3000:]}"
            for p in (tmp_path / "guardian-hosts").glob("*.log")
        ]
        return "\n".join([job_report(stores["repo"], j, tmp_path) for j in ids] + logs)

    for job_id in ids:
        wait_for(
            f"{job_id} PROCESSING",
            lambda j=job_id: stores["repo"].get(j).status == states.PROCESSING,  # type: ignore[misc]
            explain=why,
        )
    pids = {j: guardian_pid(stores, j) for j in ids}
    host_pids = {h.ref.pid for h in lcm.hosts}
    # three jobs, two per host: two host processes hold every job's guardian key
    assert len(set(pids.values())) == 2 and set(pids.values()) == host_pids, why()
    victim = pids[ids[0]]
    os.kill(victim, signal.SIGKILL)
    for job_id in ids:
        wait_for(
            f"{job_id} guarded by a live process other than the killed host",
            lambda j=job_id: (
                guardian_pid(stores, j) not in (0, victim)  # type: ignore[misc]
                and procs.ProcRef.of(guardian_pid(stores, j)) is not None
            ),
            explain=why,
        )
    for job_id in ids:
        (tmp_path / "jobs" / job_id / "go").touch()
    for job_id in ids:
        wait_for(
            f"{job_id} COMPLETED",
            lambda j=job_id: stores["repo"].get(j).status == states.COMPLETED,  # type: ignore[misc]
            explain=why,
        )
        assert history(stores["repo"], job_id).count("DEPLOYING") == 1  # resumed, not redeployed
    # the LCM lets go of ended jobs whose host lives on
    wait_for("the LCM to drop the ended jobs", lambda: not set(ids) & set(lcm.guardians))


def test_a_hosted_job_s_guardian_lines_are_in_its_own_guardian_log(
    stores: dict[str, Any], tmp_path: Path, lcm: LifecycleManager
) -> None:
    """Where an operator looks for one job's guardian (docs/control-plane-scale.md): its
    `guardian.log`, as with a guardian process; the host's log has them too."""
    job_id = submit(stores["repo"], tmp_path, "echo hosted", place=False).job_id
    wait_for("COMPLETED", lambda: stores["repo"].get(job_id).status == states.COMPLETED)
    log = tmp_path / "jobs" / job_id / "guardian.log"
    wait_for("the guardian's last line", lambda: log.exists() and "ended with 0" in log.read_text())
    lines = log.read_text().splitlines()
    assert all(f"guardian[{job_id}] host[" in line for line in lines), lines
    assert "guarded in host" in lines[0] and "guardian-hosts/" in lines[0]
    assert sum("deployed (generation" in line for line in lines) == 1
    (host_log,) = (tmp_path / "guardian-hosts").glob("*.log")
    assert f"job {job_id} deployed (generation" in host_log.read_text()
