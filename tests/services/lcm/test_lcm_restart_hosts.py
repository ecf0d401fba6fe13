"""A restarted daemon's LCM feeds the guardian hosts its predecessor started: they keep
guarding their jobs (re-adopted through their keys) and take new jobs again, through
their sockets (services/guardian/host.py), before any new host starts."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from contract import etcd_keys, procs
from contract.procs import free_port
from services.store import states
from tests.services.guardian.helpers import history, job_report, submit, wait_for

pytestmark = pytest.mark.integration

WAIT_FOR_GO = "touch ../ready\nwhile [ ! -e ../go ]; do sleep 0.1; done\n"


@pytest.fixture
def daemons(stores: dict[str, Any], tmp_path: Path) -> Iterator[Any]:
    """Starts `rhizomed --services lcm` on the test's data directory (guardian hosts of 2
    jobs); whatever is left of the daemons and of their hosts is killed after."""
    started: list[subprocess.Popen[bytes]] = []
    host_pids: set[int] = set()

    def start(name: str) -> subprocess.Popen[bytes]:
        argv = [
            sys.executable,
            "-m",
            "services.daemon",
            "--services=lcm",
            f"--etcd={stores['etcd_url']}",
            f"--mongodb-uri={stores['mongo_url']}",
            f"--data-dir={tmp_path}",
            f"--internal-address=127.0.0.1:{free_port()}",
            "--metrics-address=",
            "--guardians-per-host=2",
        ]
        log = open(tmp_path / f"daemon-{name}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        started.append(proc)
        return proc

    start.host_pids = host_pids  # type: ignore[attr-defined]
    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    for pid in host_pids:  # a host outliving every daemon (it should not): not left behind
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def holder(stores: dict[str, Any], job_id: str) -> dict[str, Any]:
    entry = stores["etcd"].get(etcd_keys.guardian_lease(job_id))
    return dict(entry.value) if entry is not None and isinstance(entry.value, dict) else {}


def test_a_restarted_daemon_gives_new_jobs_to_the_old_host_first(
    stores: dict[str, Any], tmp_path: Path, daemons: Any
) -> None:
    files = {"run.sh": WAIT_FOR_GO}
    first_job = submit(stores["repo"], tmp_path, "sh run.sh", files=files, place=False).job_id
    ids = [first_job]

    def why() -> str:
        logs = [
            f"{p.name}:\n{p.read_text(errors='replace')[-3000:]}"
            for p in [*tmp_path.glob("daemon-*.log"), *tmp_path.glob("guardian-hosts/*.log")]
        ]
        return "\n".join([job_report(stores["repo"], j, tmp_path) for j in ids] + logs)

    def processing(job_id: str) -> bool:
        return stores["repo"].get(job_id).status == states.PROCESSING and bool(
            holder(stores, job_id)
        )

    first = daemons("first")
    wait_for(f"{first_job} PROCESSING", lambda: processing(first_job), explain=why)
    old = holder(stores, first_job)
    daemons.host_pids.add(int(old["pid"]))
    assert old.get("host") and old["pid"] != first.pid, old

    # The daemon dies (not a clean stop: that would stop its hosts too); its host lives on.
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    assert procs.ref_alive(old["pid"], old["start"]), why()

    second = daemons("second")
    second_job = submit(stores["repo"], tmp_path, "sh run.sh", files=files, place=False).job_id
    ids.append(second_job)
    wait_for(f"{second_job} PROCESSING", lambda: processing(second_job), explain=why)
    new = holder(stores, second_job)
    daemons.host_pids.add(int(new["pid"]))
    # the new job's guardian runs in the old host, which still guards the first job
    assert (new["host"], new["pid"]) == (old["host"], old["pid"]), why()
    assert holder(stores, first_job).get("pid") == old["pid"], why()
    assert "found guardian host" in (tmp_path / "daemon-second.log").read_text(), why()

    for job_id in ids:
        (tmp_path / "jobs" / job_id / "go").touch()
    for job_id in ids:
        wait_for(
            f"{job_id} COMPLETED",
            lambda j=job_id: stores["repo"].get(j).status == states.COMPLETED,  # type: ignore[misc]
            explain=why,
        )
        assert history(stores["repo"], job_id).count("DEPLOYING") == 1, why()
    # a clean stop of the second daemon stops the host it found, as one it started
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=30) == 0, why()
    wait_for("the old host gone", lambda: not procs.ref_alive(old["pid"], old["start"]))
