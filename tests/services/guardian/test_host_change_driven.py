"""A guardian host steps a running job's guardian when something of the job changes, not
by a timer (issue #18: a full round of etcd reads per job every 2 s was the host's
largest steady cost per alive job). Once every learner has a status, the guardian waits
for a change under its job's prefix, its controller's exit (the host's reaper) or the
safety poll; each transition a running job makes still arrives: a controller's death
(its lease expires and its status key goes), a learner's end, a delete on the control
key. Real etcd and MongoDB-wire server, the local backend, the host in this process."""

from __future__ import annotations

import os
import signal
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from contract import etcd_keys
from contract.status import ExitCode
from services.backends.api import get_backend
from services.backends.local.backend import LocalBackend
from services.guardian.config import GuardianConfig
from services.guardian.host import GuardianHost, HostConfig, Hosted, HostedGuardian
from services.store import states
from tests.services.guardian.helpers import job_report, running_host, submit, wait_for

pytestmark = pytest.mark.integration

WAIT_FOR_GO = "touch ../ready\nwhile [ ! -e ../go ]; do sleep 0.1; done\n"
# The timer's periods in these tests: a guardian still counting something in time would
# step every 0.2 s; a settled one never (an hour), so only a change can step it.
POLL_S = 0.2
NEVER_S = 3600.0


class _Counted(HostedGuardian):
    """Counts its steps, per job."""

    steps: dict[str, int] = {}

    def step(self) -> int | None:
        _Counted.steps[self.job_id] = _Counted.steps.get(self.job_id, 0) + 1
        return super().step()


def processing(stores: dict[str, Any], job_id: str) -> dict[str, Any] | None:
    """Learner 0's status value once it is PROCESSING (its controller's pid), else None."""
    entry = stores["etcd"].get(etcd_keys.learner_status(job_id, 0))
    value = entry.value if entry is not None else None
    return value if isinstance(value, dict) and value.get("status") == "PROCESSING" else None


def settled(host: GuardianHost, job_id: str) -> bool:
    """Whether the job's guardian waits for a change (or the safety poll) only."""
    hosted = host.guardians.get(job_id)
    guardian = hosted.guardian if hosted is not None else None
    return isinstance(guardian, HostedGuardian) and guardian.idle_s(host.config) == NEVER_S


def quiet(host: GuardianHost, job_id: str) -> None:
    """Wait until the job's guardian is settled on its learners' PROCESSING and has not
    stepped for a second. Settled alone is not enough: its last read may have seen
    PROCESSING before the watch delivered that same write, which then steps it once more
    (the race a loaded CI machine lost)."""
    last: tuple[int, float] = (-1, time.monotonic())

    def still() -> bool:
        nonlocal last
        hosted = host.guardians.get(job_id)
        guardian = hosted.guardian if hosted is not None else None
        ready = (
            hosted is not None
            and not hosted.running
            and not hosted.due
            and isinstance(guardian, HostedGuardian)
            and not guardian.changed.is_set()
            and settled(host, job_id)
            and all(
                isinstance(e.value, dict) and e.value.get("status") == "PROCESSING"
                for e in guardian._seen.values()
            )
        )
        steps = _Counted.steps.get(job_id, 0)
        if not ready or steps != last[0]:
            last = (steps, time.monotonic())
            return False
        return time.monotonic() - last[1] >= 5 * POLL_S

    wait_for(f"{job_id}'s guardian quiet", still)


def test_a_running_job_s_guardian_steps_only_on_changes_and_every_transition_still_arrives(
    stores: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("services.guardian.host.HostedGuardian", _Counted)
    _Counted.steps = {}
    killed = submit(stores["repo"], tmp_path, "sleep 120").job_id
    finishes = submit(stores["repo"], tmp_path, "sh run.sh", files={"run.sh": WAIT_FOR_GO}).job_id
    ids = [killed, finishes]

    def report() -> str:
        return "\n".join(job_report(stores["repo"], j, tmp_path) for j in ids)

    # No reaper: a controller's death reaches the guardian only through etcd (its lease,
    # etcd's shortest).
    with running_host(
        stores,
        tmp_path,
        LocalBackend(),
        poll_s=POLL_S,
        safety_poll_s=NEVER_S,
        learner_lease_ttl_s=2,
    ) as (host, ended):
        for job_id in ids:
            assert host.adopt(job_id)
        for job_id in ids:
            wait_for(f"{job_id} PROCESSING", partial(processing, stores, job_id), explain=report)
        for job_id in ids:
            quiet(host, job_id)
        # Nothing changes: no step at all (at the old 2 s poll for every guardian, at
        # POLL_S here, there would be seven of each).
        before = dict(_Counted.steps)
        time.sleep(7 * POLL_S)
        assert _Counted.steps == before, "a settled guardian was stepped without a change"

        # A controller dies: its status key goes when its lease expires (the watch), the
        # guardian steps and starts a new one. Nothing else could have stepped it.
        first = processing(stores, killed)
        assert first is not None
        os.kill(int(first["pid"]), signal.SIGKILL)
        wait_for(
            "a new controller for the killed job",
            lambda: (c := processing(stores, killed)) is not None and c["pid"] != first["pid"],
            explain=report,
        )
        assert stores["repo"].get(killed).status == states.PROCESSING
        wait_for("settled again", lambda: settled(host, killed))

        # A learner ends: its COMPLETED status (a change) ends the job.
        (tmp_path / "jobs" / finishes / "go").touch()
        wait_for(
            "the other job COMPLETED",
            lambda: stores["repo"].get(finishes).status == states.COMPLETED,
            explain=report,
        )
        # A delete on the control key (a change) ends the first.
        stores["etcd"].put(etcd_keys.control(killed), {"action": "delete", "reason": "test"})
        wait_for(
            "the killed job DELETED",
            lambda: stores["repo"].get(killed).status == states.DELETED,
            explain=report,
        )
        wait_for("both guardians ended", lambda: not host.guardians)
        assert host.ended == {killed: 0, finishes: 0}
    assert ended == [ExitCode.OK], report()


class _RecordingHost(GuardianHost):
    """Records which guardians a child's exit stepped."""

    woken: list[tuple[int, list[str]]] = []

    def _on_child_exit(self, pid: int) -> None:
        with self._lock:
            hosted = list(self.guardians.values())
        mine = [h.job_id for h in hosted if isinstance(h.guardian, HostedGuardian)]
        of_pid = [j for j in mine if self.guardians[j].guardian.runs_controller(pid)]  # type: ignore[attr-defined]
        _RecordingHost.woken.append((pid, of_pid))
        super()._on_child_exit(pid)


def test_a_controller_s_exit_steps_its_guardian_through_the_host_s_reaper(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    """The host is its controllers' subreaper: their exit steps the guardian whose
    controller it was, at once rather than when the controller's lease expires. Its
    children are the test process's here, so the reaper runs in this process (stopped at
    the end, before the test servers exit)."""
    from services.guardian.__main__ import WaitingReaper

    job_id = submit(stores["repo"], tmp_path, "sleep 120").job_id
    reaper = WaitingReaper()
    reaper.start()
    _RecordingHost.woken = []

    def report() -> str:
        return job_report(stores["repo"], job_id, tmp_path)

    try:
        with running_host(
            stores,
            tmp_path,
            LocalBackend(reaper=reaper),
            poll_s=POLL_S,
            safety_poll_s=NEVER_S,
            host_type=_RecordingHost,
            reaper=reaper,
        ) as (host, ended):
            assert host.adopt(job_id)
            first = wait_for(
                "learner 0 PROCESSING", lambda: processing(stores, job_id), explain=report
            )
            wait_for("its guardian settled", lambda: settled(host, job_id))
            pid = int(first["pid"])
            os.kill(pid, signal.SIGKILL)
            wait_for(
                "a new controller",
                lambda: (c := processing(stores, job_id)) is not None and c["pid"] != pid,
                explain=report,
            )
            assert (pid, [job_id]) in _RecordingHost.woken, _RecordingHost.woken
            stores["etcd"].put(etcd_keys.control(job_id), {"action": "delete", "reason": "test"})
            wait_for(
                "the job DELETED",
                lambda: stores["repo"].get(job_id).status == states.DELETED,
                explain=report,
            )
    finally:
        reaper.stop()
    assert ended == [ExitCode.OK], report()


class _Stub:
    """A guardian that only counts its steps (for the host's bookkeeping alone)."""

    def __init__(self) -> None:
        self.wake = threading.Event()
        self.watching = ("deployed", "spec")
        self.steps = 0
        self.changes = 0

    def _on_change(self, changes: list[Any], full: bool) -> None:
        self.changes += 1
        self.wake.set()

    def step(self) -> int | None:
        self.steps += 1
        return None


def test_a_fresh_read_of_the_jobs_prefix_steps_every_guardian(tmp_path: Path) -> None:
    """After the host's watch read the prefix afresh (its stream broke and changes may
    have been compacted away), every guardian steps, not only those with keys in the
    read: a job whose keys all went meanwhile is looked at too."""

    def make_config(job_id: str, env: dict[str, str]) -> GuardianConfig:
        return GuardianConfig(job_id, "", "", tmp_path)

    host = GuardianHost(
        HostConfig("fresh", poll_s=NEVER_S, safety_poll_s=NEVER_S),
        None,  # type: ignore[arg-type]  # no store is reached: the stubs step
        None,  # type: ignore[arg-type]
        get_backend("simulated"),
        make_config,
    )
    stubs = {job_id: _Stub() for job_id in ("job-a", "job-b")}
    for job_id, stub in stubs.items():
        # (never made again: a stub does not raise)
        host.guardians[job_id] = Hosted(job_id, stub, HostedGuardian)  # type: ignore[arg-type]
    try:
        host._on_change([], full=False)
        time.sleep(0.2)
        assert [s.steps for s in stubs.values()] == [0, 0]
        host._on_change([], full=True)
        wait_for("both stepped", lambda: all(s.steps == 1 for s in stubs.values()))
        assert all(s.changes == 1 for s in stubs.values())
    finally:
        host.close()


def test_how_long_a_hosted_guardian_waits_without_a_change(tmp_path: Path) -> None:
    """`HostedGuardian.idle_s`: the safety poll only once it is deployed and settled (every
    learner has a status); the short poll while something is counted in time."""
    config = HostConfig("idle", poll_s=2.0, safety_poll_s=30.0, halt_poll_s=0.5)
    guardian = HostedGuardian(
        GuardianConfig("job-idle", "", "", tmp_path),
        None,  # type: ignore[arg-type]  # nothing is read: only its state is asked
        None,  # type: ignore[arg-type]
        get_backend("simulated"),
    )
    assert guardian.idle_s(config) == 2.0  # not deployed yet
    guardian.watching = ("deployed", "spec")  # type: ignore[assignment]
    assert guardian.idle_s(config) == 2.0  # a learner without a status: its start grace
    guardian._settled = True
    assert guardian.idle_s(config) == 30.0
    guardian.key_deleted = True  # our key went: polled until the lease says it is lost
    assert guardian.idle_s(config) == 2.0
    guardian.key_deleted = False
    guardian.halt_deadline = time.monotonic() + 10  # a halt waits for its learners
    assert guardian.idle_s(config) == 0.5
