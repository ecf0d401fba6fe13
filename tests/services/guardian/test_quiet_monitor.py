"""A guardian process reads etcd only after a change under its job's prefix (or at its
safety poll): while the job runs quietly its steps only check that the controllers still
run, and a controller that dies is still found by them and restarted (issue #16). An
in-process guardian over the real etcd and MongoDB-wire server and the local backend."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from contract import etcd_keys
from contract.etcd import EtcdClient
from services.backends.local.backend import LocalBackend
from services.guardian.config import GuardianConfig
from services.guardian.guardian import Guardian
from services.store import states
from services.store.jobs import JobRecord
from tests.services.guardian.helpers import job_report, submit, wait_for

pytestmark = pytest.mark.integration


class CountingEtcd:
    """The guardian's etcd client, counting its reads (everything else passes through)."""

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self.reads = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name not in ("get", "get_prefix"):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.reads += 1
            return attr(*args, **kwargs)

        return counted


@dataclass
class SleepingJob:
    """A submitted one-learner job whose command sleeps, and the config of its guardian."""

    stores: dict[str, Any]
    tmp_path: Path
    job: JobRecord
    config: GuardianConfig

    def report(self) -> str:
        return job_report(self.stores["repo"], self.job.job_id, self.tmp_path)

    def controller(self) -> dict[str, Any] | None:
        """Learner 0's status value once it is PROCESSING (its controller's pid)."""
        entry = self.stores["etcd"].get(etcd_keys.learner_status(self.job.job_id, 0))
        value = entry.value if entry is not None else None
        return value if isinstance(value, dict) and value.get("status") == "PROCESSING" else None


@pytest.fixture
def sleeping(stores: dict[str, Any], tmp_path: Path) -> SleepingJob:
    job = submit(stores["repo"], tmp_path, "sleep 120")
    config = GuardianConfig(
        job_id=job.job_id,
        etcd_url=stores["etcd_url"],
        mongodb_uri=stores["mongo_url"],
        data_dir=tmp_path,
        learner_grace_s=1.0,
    )
    return SleepingJob(stores, tmp_path, job, config)


class CountedQuietSteps(Guardian):
    """Counts the steps that needed no etcd read."""

    quiet = 0

    def _quiet_step(self) -> bool:
        quiet = super()._quiet_step()
        self.quiet += quiet
        return quiet


def test_quiet_steps_read_nothing_and_a_dead_controller_is_still_restarted(
    stores: dict[str, Any], sleeping: SleepingJob
) -> None:
    job, report, controller = sleeping.job, sleeping.report, sleeping.controller
    etcd = CountingEtcd(stores["etcd"])
    guardian = CountedQuietSteps(sleeping.config, etcd, stores["repo"], LocalBackend())  # type: ignore[arg-type]
    guardian.safety_poll_s = 3600.0  # only a change may bring a full round here
    ended: list[int] = []
    thread = threading.Thread(target=lambda: ended.append(guardian.run()), daemon=True)
    thread.start()

    try:
        wait_for(
            "the job PROCESSING",
            lambda: stores["repo"].get(job.job_id).status == states.PROCESSING,
            explain=report,
        )
        first = wait_for("learner 0 PROCESSING", controller, explain=report)
        # Quiet steps from here: no etcd read between three of them.
        wait_for("a quiet step", lambda: guardian.quiet >= 1, explain=report)
        reads, quiet = etcd.reads, guardian.quiet
        wait_for("three more quiet steps", lambda: guardian.quiet >= quiet + 3, explain=report)
        assert etcd.reads == reads, "a quiet step read etcd"

        # The controller dies (its lease would outlive it by the TTL): the quiet step
        # sees it gone, and the full round that follows starts a new one.
        os.kill(int(first["pid"]), signal.SIGKILL)
        wait_for(
            "a new controller for learner 0",
            lambda: (c := controller()) is not None and c["pid"] != first["pid"],
            explain=report,
        )
        assert stores["repo"].get(job.job_id).status == states.PROCESSING
    finally:
        stores["etcd"].put(etcd_keys.control(job.job_id), {"action": "delete"})
        thread.join(60)
    assert ended == [0], report()
    assert stores["repo"].get(job.job_id).status == states.DELETED


def test_a_guardian_whose_controllers_are_its_children_waits_for_their_exit_not_a_poll(
    stores: dict[str, Any], sleeping: SleepingJob
) -> None:
    """In a guardian process the reaper wakes the guardian when a controller it started
    exits (`WaitingReaper.on_exit`), so between two changes the guardian sleeps until its
    safety poll instead of a quick step every `poll_s`; a SIGKILLed controller is still
    found at once and replaced. Its children are the test process's, so the reaper runs
    here (stopped at the end, before the test servers exit)."""
    from services.guardian.__main__ import WaitingReaper

    job, report, controller = sleeping.job, sleeping.report, sleeping.controller
    reaper = WaitingReaper()
    reaper.start()
    guardian = CountedQuietSteps(
        sleeping.config, stores["etcd"], stores["repo"], LocalBackend(reaper=reaper)
    )
    exits: list[int] = []

    def on_exit(pid: int) -> None:
        exits.append(1)
        guardian.wake.set()

    reaper.on_exit = on_exit  # as services/guardian/__main__.py wires it
    guardian.exit_wakes = reaper.watches
    guardian.safety_poll_s = 3600.0
    ended: list[int] = []
    thread = threading.Thread(target=lambda: ended.append(guardian.run()), daemon=True)
    thread.start()

    try:
        first = wait_for("learner 0 PROCESSING", controller, explain=report)
        wait_for(
            "the guardian settled on the running learner",
            lambda: guardian.quiet_wait_s() > 60 and guardian._seen,
            explain=report,
        )
        # its only controller is a child whose exit wakes it: no quick step to take
        quiet = guardian.quiet
        time.sleep(1.5)  # three quick steps at the 0.5 s poll
        assert guardian.quiet == quiet, "the guardian polled its controller's pid"
        # without the reaper's word (a controller adopted from an earlier guardian), the
        # quick steps every poll_s are back
        guardian.exit_wakes = lambda pid: False
        assert guardian.quiet_wait_s() == guardian.poll_s
        guardian.exit_wakes = reaper.watches

        os.kill(int(first["pid"]), signal.SIGKILL)
        wait_for(
            "a new controller for learner 0",
            lambda: (c := controller()) is not None and c["pid"] != first["pid"],
            explain=report,
        )
        assert exits, "the controller's exit did not wake the guardian"
        assert stores["repo"].get(job.job_id).status == states.PROCESSING
        # its guardian key deleted (as when its lease expires): `lease.lost` follows at
        # the keep-alive's next refresh without waking it, so it polls until then
        wait_for("settled again", lambda: guardian.quiet_wait_s() > 60, explain=report)
        stores["etcd"].delete(etcd_keys.guardian_lease(job.job_id))
        wait_for("the deletion seen", lambda: guardian.quiet_wait_s() == guardian.poll_s)
    finally:
        stores["etcd"].put(etcd_keys.control(job.job_id), {"action": "delete"})
        thread.join(60)
        reaper.stop()
    assert ended == [0], report()
    assert stores["repo"].get(job.job_id).status == states.DELETED
