"""The simulated backend's learners that wait for SIM_UNTIL_FILE: one poller thread of
the backend releases them all when the file appears, and a stop still ends one at once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from contract import etcd_keys
from services.backends.api import JobSpec
from services.backends.simulated.backend import SimulatedBackend
from services.manifest import parse_manifest
from tests.services.guardian.helpers import wait_for

pytestmark = pytest.mark.integration


def spec(job_id: str, tmp_path: Path, stores: dict[str, Any], until: Path) -> JobSpec:
    manifest = parse_manifest(
        "name: t\nlearners: 1\nmemory: 16MiB\nframework:\n  command: simulated\n"
        f"env:\n  SIM_SECONDS: '0'\n  SIM_LOG_LINES: '0'\n  SIM_UNTIL_FILE: '{until}'\n"
        "  SIM_LEASE_TTL_S: '7'\n"
    )
    job_dir = tmp_path / job_id
    return JobSpec(job_id, "simulated", 1, str(job_dir), "", "", stores["etcd_url"], manifest)


def status(stores: dict[str, Any], job_id: str) -> dict[str, Any]:
    entry = stores["etcd"].get(etcd_keys.learner_status(job_id, 0))
    return dict(entry.value) if entry is not None else {}


def test_waiting_learners_are_released_together_by_one_poller_or_stopped_alone(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    backend = SimulatedBackend()
    until = tmp_path / "release"
    jobs = ["sim-a", "sim-b", "sim-c"]
    for job_id in jobs:
        backend.start_learner(spec(job_id, tmp_path, stores, until), 0)

    def reached(job_id: str, wanted: str) -> Callable[[], bool]:
        return lambda: status(stores, job_id).get("status") == wanted

    for job_id in jobs:
        wait_for(f"{job_id} PROCESSING", reached(job_id, "PROCESSING"))
    lease = stores["etcd"].get(etcd_keys.learner_status("sim-a", 0))
    assert lease is not None and lease.lease  # under a lease of SIM_LEASE_TTL_S
    backend.stop_learners("sim-c", grace_s=10)  # a stop ends a waiting learner at once
    assert status(stores, "sim-c")["status"] == "HALTED"
    assert backend.running("sim-a") == [0] and backend.running("sim-b") == [0]
    until.touch()
    for job_id in ("sim-a", "sim-b"):
        wait_for(f"{job_id} COMPLETED", reached(job_id, "COMPLETED"))
    wait_for("the poller to end", lambda: backend._poller is None)
