"""A guardian host sleeps while nothing is due: its main loop waits for the next step due
or an event instead of ticking 10 times a second, its reaper waits in `waitid` for a
child's exit instead of polling 20 times a second, and its grpc waits wake once a second
(issue #16: the platform's processes share the cores a running job's workers train on).
A guardian whose poll period is over is still stepped without any change to its job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from contract.status import ExitCode
from services.backends.api import get_backend
from services.guardian.guardian import EXIT_TERMINATED
from services.guardian.host import GuardianHost, HostedGuardian, socket_path
from tests.services.guardian.helpers import running_host, wait_for

pytestmark = pytest.mark.integration


def python_thread_wakeups(pid: int) -> dict[int, int]:
    """Voluntary context switches (each time a thread went to sleep, so woke again) of
    each Python thread of `pid`; grpc's own C threads (named `event_engine`,
    `grpc_global_tim`, `lifeguard`) are left out: their timers are grpc's, not ours."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() != Path(sys.executable).name[:15]:
                continue
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                out[int(task.name)] = int(line.split()[1])
    return out


def test_an_idle_host_process_sleeps_instead_of_polling(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    argv = [
        sys.executable,
        "-m",
        "services.guardian.host",
        "--host-id=idle",
        f"--etcd={stores['etcd_url']}",
        f"--mongodb-uri={stores['mongo_url']}",
        f"--data-dir={tmp_path}",
    ]
    with open(tmp_path / "host.log", "ab") as log:
        # its input stays open: a host with no job yet, waiting for an LCM to give one
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for("the host listening", lambda: socket_path(tmp_path, "idle").exists())
        time.sleep(1.0)  # its start-up (imports, first connections) is not idle
        before = python_thread_wakeups(proc.pid)
        time.sleep(3.0)
        after = python_thread_wakeups(proc.pid)
        assert proc.poll() is None, (tmp_path / "host.log").read_text()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    woke = {tid: after[tid] - before.get(tid, 0) for tid in after}
    # Measured over these 3 s: the main thread 30 times (10 Hz) before, 0 now; all Python
    # threads 186-191 (the reaper 60, the lease's stream 30) before, 56-62 now (pymongo's
    # three monitors at 2 Hz, grpc's channel thread at 5 Hz). A loaded machine can only
    # make a polling thread wake less often, never a sleeping one more.
    assert woke[proc.pid] <= 3, woke
    assert sum(woke.values()) < 120, woke


class _Polled(HostedGuardian):
    """A deployed guardian whose steps only count: nothing changes under its job, so only
    the host's timer steps it."""

    steps = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.watching = ("pretend", "deployed")  # type: ignore[assignment]

    def step(self) -> int | None:
        if self.terminate.is_set():
            return EXIT_TERMINATED
        _Polled.steps += 1
        return None


class _CountedTicks(GuardianHost):
    ticks = 0

    def tick(self, until: float = float("inf")) -> float:
        _CountedTicks.ticks += 1
        return super().tick(until)


def test_the_host_loop_sleeps_while_nothing_is_due_and_steps_a_guardian_when_its_poll_is_over(
    stores: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("services.guardian.host.HostedGuardian", _Polled)
    _Polled.steps = 0
    _CountedTicks.ticks = 0
    with running_host(
        stores,
        tmp_path,
        get_backend("simulated"),
        poll_s=0.3,
        host_id="loop",
        host_type=_CountedTicks,
    ) as (host, ended):
        wait_for("the loop's first tick", lambda: _CountedTicks.ticks >= 1)
        time.sleep(1.5)
        # no guardian: the loop sleeps until its re-authentication report (every 5 s);
        # at 10 Hz it ticked 15 times here
        assert _CountedTicks.ticks <= 2, _CountedTicks.ticks
        assert host.adopt("job-polled")
        # no change under the job's prefix after its guardian key: each of these steps is
        # the timer's (the loop woke for the step due, told by the step before it)
        wait_for("five steps by the timer", lambda: _Polled.steps >= 5, timeout_s=30)
        host.terminate.set()
        host.changed.set()
    assert ended == [ExitCode.PREEMPTED]  # every guardian detached, as on SIGTERM
