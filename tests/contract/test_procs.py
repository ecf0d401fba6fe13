"""Process labels, references and the reaper (real processes, no platform)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from contract import procs
from contract.env import Role, labels


def _labelled_sleeper(job_id: str, rank: int, role: Role) -> subprocess.Popen[bytes]:
    env = {**os.environ, **labels(job_id, rank, role)}
    # A shell with a child: killing must take the whole group, not just the leader.
    return subprocess.Popen(["/bin/sh", "-c", "sleep 60 & wait"], env=env, start_new_session=True)


def test_labelled_finds_by_job_rank_and_role_and_kill_takes_the_groups() -> None:
    job = f"job-test-{uuid.uuid4().hex[:8]}"
    a = _labelled_sleeper(job, 0, Role.LEARNER)
    b = _labelled_sleeper(job, 1, Role.CONTROLLER)
    try:
        found = {}
        for _ in range(100):
            found = {
                "all": procs.labelled(job),
                "rank0": procs.labelled(job, rank=0),
                "ctl": procs.labelled(job, role=Role.CONTROLLER),
            }
            if len(found["all"]) == 4:
                break
            procs.time.sleep(0.02)
        assert len(found["all"]) == 4  # two shells and two sleeps
        assert a.pid in found["rank0"] and b.pid not in found["rank0"]
        assert b.pid in found["ctl"] and a.pid not in found["ctl"]
        assert procs.labelled("job-someone-else") == []
        assert procs.kill_labelled(job, rank=0) == 2
        a.wait(timeout=5)
        assert procs.labelled(job, rank=0) == []
        assert procs.labelled(job, rank=1) != []
    finally:
        procs.kill_labelled(job)
        a.wait(timeout=5)
        b.wait(timeout=5)
    assert procs.labelled(job) == []


def test_procref_tells_a_reused_pid_from_the_original() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    ref = procs.ProcRef.of(proc.pid)
    assert ref is not None and ref.alive()
    assert not procs.ProcRef(proc.pid, ref.start + 1).alive()
    assert not procs.ref_alive(None, ref.start)
    proc.kill()
    proc.wait()
    assert not ref.alive()


def test_reaper_reports_exit_codes_of_watched_children() -> None:
    reaper = procs.Reaper(interval_s=0.01)
    codes: dict[int, int] = {}
    proc = subprocess.Popen(["/bin/sh", "-c", "exit 5"])
    reaper.watch(proc.pid, lambda pid, code: codes.__setitem__(pid, code))
    reaper.start()
    try:
        for _ in range(500):
            if proc.pid in codes:
                break
            procs.time.sleep(0.01)
    finally:
        reaper.stop()
    assert codes == {proc.pid: 5}


def test_free_ports_are_below_the_ephemeral_range_and_bindable() -> None:
    """A listening port picked from the ephemeral range can be taken by any process's
    outgoing connection before its server binds it; free_port picks below it."""
    import socket

    low, _ = procs.ephemeral_port_range()
    assert low > procs._LOWEST_LISTEN_PORT + 1000, "this machine leaves no room below its range"
    ports = {procs.free_port() for _ in range(20)}
    assert all(procs._LOWEST_LISTEN_PORT <= p < low for p in ports)
    assert len(ports) > 1  # random picks, not one port for every caller
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_somebody_listens_on_is_not_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", procs.free_port()))
        taken.listen()
        busy = taken.getsockname()[1]
        other = procs.free_port()
        assert other != busy
        picks = iter([busy, busy, other])
        monkeypatch.setattr(procs._port_random, "randint", lambda a, b: next(picks))
        assert procs.free_port() == other
