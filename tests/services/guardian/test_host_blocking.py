"""A guardian host whose threads could be held: a backend call that never returns (bounded
by its timeout, services/backends/api.py TimedBackend) and halts waiting for their
learners (HostedGuardian: no step thread waits). Both against real etcd and a real
MongoDB-wire server, with the simulated backend's learners."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from contract import etcd_keys
from contract.status import ExitCode
from services.backends.api import Backend, BackendTimeout, JobSpec, TimedBackend, cannot_block
from services.backends.simulated.backend import SimulatedBackend
from services.guardian.config import GuardianConfig
from services.guardian.host import (
    GuardianHost,
    HostConfig,
    HostedGuardian,
    assignment,
    connect_host,
    socket_path,
)
from services.store import states
from services.store.errors import StoreUnavailable
from tests.services.guardian.helpers import job_report, submit, wait_for

SYSTEM_PYTHON = "/usr/bin/python3"  # not the venv's, which another user may not run


class _Hangs(SimulatedBackend):
    """A backend whose `start_learner` for the jobs in `stuck` never returns (an engine
    that stopped answering) until the test ends; every other call is the simulated one.
    `events` records what happened, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.stuck: set[str] = set()
        self.unstick = threading.Event()
        self.events: list[str] = []

    def start_learner(self, job: JobSpec, rank: int, restart: int = 0) -> int:
        if job.job_id in self.stuck:
            self.events.append(f"stuck {job.job_id}")
            self.unstick.wait(300)
            self.events.append(f"unstuck {job.job_id}")
        else:
            self.events.append(f"start {job.job_id}")
        return super().start_learner(job, rank, restart)


class _Lingers(SimulatedBackend):
    """Simulated learners that keep running through a halt (they ignore the control key,
    as a learner saving a large checkpoint would) until the test lets them go."""

    def __init__(self) -> None:
        super().__init__()
        self.released: set[str] = set()

    def controller_alive(self, job_id: str, rank: int, status: dict[str, Any]) -> bool:
        return job_id not in self.released and super().controller_alive(job_id, rank, status)


@pytest.fixture
def host_of(stores: dict[str, Any], tmp_path: Path) -> Iterator[Any]:
    """An in-process host over `backend` with one ticker thread (what `GuardianHost.run`
    does, without reading assignments); closed after the test."""
    made: list[tuple[GuardianHost, threading.Event]] = []

    def make(backend: Backend, config: HostConfig, **guardian: Any) -> GuardianHost:
        def make_config(job_id: str, env: dict[str, str]) -> GuardianConfig:
            return GuardianConfig(
                job_id, stores["etcd_url"], stores["mongo_url"], tmp_path, **guardian
            )

        host = GuardianHost(config, stores["etcd"], stores["repo"], backend, make_config).start()
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(0.05):
                host.tick()

        threading.Thread(target=tick, daemon=True).start()
        made.append((host, stop))
        return host

    yield make
    for host, stop in made:
        stop.set()
        host.close()


# -- backend calls with timeouts ---------------------------------------------------------
def test_a_timed_backend_call_that_hangs_raises_and_frees_its_caller() -> None:
    """TimedBackend alone (no servers): the hung call's caller gets BackendTimeout naming
    the call, the job and the limit; `on_timeout` heard it first; other calls pass."""
    hung = _Hangs()
    hung.stuck.add("job-x")
    told: list[str] = []
    timed = TimedBackend(hung, {"start_learner": 0.2}, on_timeout=told.append)
    spec = JobSpec("job-x", "true", 1, "/nonexistent", "", "", "", manifest=None)  # type: ignore[arg-type]
    try:
        with pytest.raises(BackendTimeout) as raised:
            timed.start_learner(spec, 0)
        assert "start_learner for job job-x did not return within 0.2 s" in str(raised.value)
        assert told == [str(raised.value)]
        assert hung.events == ["stuck job-x"]  # the call is still stuck; its caller is not
        assert timed.running("job-y") == []  # another call goes through the same wrapper
    finally:
        hung.unstick.set()
        timed.close()


class _Where(SimulatedBackend):
    """Records the thread each of its calls ran in."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: dict[str, str] = {}

    def _here(self, call: str) -> None:
        self.threads[call] = threading.current_thread().name

    @cannot_block
    def start_helper(self, job: JobSpec) -> None:
        self._here("start_helper")

    def controller_alive(self, job_id: str, rank: int, status: dict[str, Any]) -> bool:
        """An override of a call the simulated backend marks: not marked itself (it could
        wait on something of its own), so bounded again."""
        self._here("controller_alive")
        return True

    def running(self, job_id: str) -> list[int]:
        self._here("running")
        return []


def test_a_call_that_cannot_block_runs_in_its_caller_s_thread_every_other_on_the_pool() -> None:
    """TimedBackend alone (no servers): a call its backend marks `cannot_block` is no hop to
    the pool (issue #18: two in each hosted guardian's monitoring round); every other call
    keeps its thread and its timeout, an unmarked override of a marked call too."""
    where = _Where()
    timed = TimedBackend(where)
    spec = JobSpec("job-x", "true", 1, "/nonexistent", "", "", "", manifest=None)  # type: ignore[arg-type]
    try:
        timed.start_helper(spec)
        assert timed.controller_alive("job-x", 0, {})
        assert timed.running("job-x") == []
    finally:
        timed.close()
    caller = threading.current_thread().name
    assert where.threads["start_helper"] == caller
    assert where.threads["controller_alive"] != caller
    assert where.threads["running"] != caller
    assert where.threads["controller_alive"].startswith("backend")


def test_which_calls_of_each_backend_cannot_block() -> None:
    """The marks the backends carry: a monitoring round's `start_helper` and
    `controller_alive` where they only look at memory or /proc (local, simulated); bounded
    where they can wait (docker: a lock file, a process started, the engine's event
    stream synced; Kubernetes: the pod watch synced)."""
    from services.backends.docker.backend import DockerBackend
    from services.backends.kubernetes.backend import KubernetesBackend
    from services.backends.local.backend import LocalBackend

    def marked(backend: type[Backend]) -> set[str]:
        calls = ("start_helper", "controller_alive", "start_learner", "stop_learners")
        return {c for c in calls if getattr(getattr(backend, c), "cannot_block", False)}

    assert marked(LocalBackend) == {"start_helper", "controller_alive"}
    assert marked(SimulatedBackend) == {"start_helper", "controller_alive"}
    assert marked(DockerBackend) == set()
    assert marked(KubernetesBackend) == {"start_helper"}


@pytest.mark.integration
def test_a_stuck_backend_call_fails_its_job_s_deploy_and_frees_the_deploy_thread(
    stores: dict[str, Any], tmp_path: Path, host_of: Any
) -> None:
    """One deploy thread; the first job's start_learner never returns. With timeouts the
    thread gives up on it: that job's history says which call timed out (its deploy fails,
    one attempt allowed), and the second job deploys on the same thread and completes
    while the first call is still stuck."""
    backend = _Hangs()
    stuck = submit(stores["repo"], tmp_path, "simulated", env={"SIM_SECONDS": "0.2"}).job_id
    other = submit(stores["repo"], tmp_path, "simulated", env={"SIM_SECONDS": "0.2"}).job_id
    backend.stuck.add(stuck)
    host = host_of(
        backend,
        HostConfig("timeouts", poll_s=0.2, deploy_threads=1, backend_timeouts={"start_learner": 1}),
        deploy_attempts=1,
    )

    def why() -> str:
        return "\n".join(job_report(stores["repo"], j, tmp_path) for j in (stuck, other)) + str(
            backend.events
        )

    try:
        assert host.adopt(stuck)
        wait_for("the stuck call", lambda: backend.events == [f"stuck {stuck}"], explain=why)
        assert host.adopt(other)
        wait_for(
            "the other job COMPLETED",
            lambda: stores["repo"].get(other).status == states.COMPLETED,
            explain=why,
        )
        # in this order: stuck, then the other job started on the freed deploy thread,
        # the stuck call still not returned
        assert backend.events == [f"stuck {stuck}", f"start {other}"], why()
        job = stores["repo"].get(stuck)
        assert job.status == states.FAILED, why()
        messages = [h.message for h in job.history]
        timed_out = f"backend call start_learner for job {stuck} did not return within 1 s"
        assert any(m.startswith(timed_out) for m in messages), messages
        assert timed_out in job.status_message  # and the deploy's failure says why
    finally:
        backend.unstick.set()


# -- halts without a step thread waiting -------------------------------------------------
@pytest.mark.integration
def test_halts_in_flight_do_not_stop_another_job_s_steps(
    stores: dict[str, Any], tmp_path: Path, host_of: Any
) -> None:
    """Two step threads, four jobs halting whose learners take their time (their grace is
    300 s), and a fifth job. While the four halts are in flight, the fifth job's steps
    run: it completes before any of them is HALTED. A halt waiting inside its step would
    hold both step threads until the grace ran out, and the fifth job would wait too."""
    backend = _Lingers()
    until = tmp_path / "never"
    go = tmp_path / "go"
    halting = [
        submit(stores["repo"], tmp_path, "simulated", env={"SIM_UNTIL_FILE": str(until)}).job_id
        for _ in range(4)
    ]
    other = submit(stores["repo"], tmp_path, "simulated", env={"SIM_UNTIL_FILE": str(go)}).job_id
    ids = [*halting, other]
    host = host_of(
        backend,
        HostConfig("halts", poll_s=0.2, halt_poll_s=0.2, step_threads=2),
        learner_grace_s=300.0,
    )

    def why() -> str:
        return "\n".join(job_report(stores["repo"], j, tmp_path) for j in ids)

    def status(job_id: str) -> str:
        return str(stores["repo"].get(job_id).status)

    try:
        for job_id in ids:
            assert host.adopt(job_id)
        for job_id in ids:
            wait_for(f"{job_id} PROCESSING", lambda j=job_id: status(j) == states.PROCESSING)  # type: ignore[misc]
        for job_id in halting:
            stores["etcd"].put(etcd_keys.control(job_id), {"action": "halt", "reason": "test"})

        def in_flight(job_id: str) -> bool:
            hosted = host.guardians.get(job_id)
            guardian = hosted.guardian if hosted is not None else None
            return isinstance(guardian, HostedGuardian) and guardian.halt_deadline is not None

        for job_id in halting:
            wait_for(f"{job_id}'s halt in flight", lambda j=job_id: in_flight(j), explain=why)  # type: ignore[misc]
        go.touch()
        wait_for("the fifth job COMPLETED", lambda: status(other) == states.COMPLETED, explain=why)
        # event order: the fifth job ended while all four halts were still waiting
        assert [status(j) for j in halting] == [states.PROCESSING] * 4, why()
        assert all(in_flight(j) for j in halting), why()
        backend.released.update(halting)  # the learners have saved: the halts end
        for job_id in halting:
            wait_for(f"{job_id} HALTED", lambda j=job_id: status(j) == states.HALTED, explain=why)  # type: ignore[misc]
    finally:
        until.touch()


# -- the socket a later LCM gives jobs through --------------------------------------------
def test_a_host_s_socket_greets_with_its_jobs_even_under_a_deep_data_dir(tmp_path: Path) -> None:
    """No servers: a host listening under a path longer than a Unix socket address holds
    (108 bytes) is reached all the same; the file is 0600; the greeting names the host
    and its pid; an assignment on the connection reaches `adopt`; close removes the file."""
    deep = tmp_path.joinpath(*["a-rather-long-directory-name"] * 5)
    path = socket_path(deep, "h-deep")
    assert len(os.fsencode(path)) > 108
    adopted: list[tuple[str, dict[str, str]]] = []

    class _Recording(GuardianHost):
        def adopt(self, job_id: str, env: dict[str, str] | None = None) -> bool:
            adopted.append((job_id, dict(env or {})))
            return True

    host = _Recording(HostConfig("h-deep"), None, None, SimulatedBackend(), None)  # type: ignore[arg-type]
    host.listen(path)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        conn, about = connect_host(path)
        assert (about["host_id"], about["pid"], about["jobs"]) == ("h-deep", os.getpid(), [])
        conn.sendall(assignment("job-1", {"K": "v"}).encode())
        conn.close()
        wait_for("the assignment", lambda: adopted == [("job-1", {"K": "v"})])
    finally:
        host.close()
    assert not path.exists()


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
    reason="needs root to act as another user, and a Python that user may run",
)
def test_another_user_cannot_give_a_host_jobs() -> None:
    """A learner's uid (any other user) cannot reach a host's socket: every directory on
    the way is open to it here, the socket file (0600) is not."""
    top = Path(tempfile.mkdtemp(prefix="rz-host-sock-"))
    top.chmod(0o755)
    path = socket_path(top, "h-private")
    adopted: list[str] = []

    class _Recording(GuardianHost):
        def adopt(self, job_id: str, env: dict[str, str] | None = None) -> bool:
            adopted.append(job_id)
            return True

    host = _Recording(HostConfig("h-private"), None, None, SimulatedBackend(), None)  # type: ignore[arg-type]
    host.listen(path)
    path.parent.chmod(0o755)
    code = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n"
        f"    s.connect({str(path)!r})\n"
        "except PermissionError:\n"
        "    sys.exit(13)\n"
        's.sendall(b\'{"job_id": "job-evil", "env": {}}\\n\')\n'
    )
    try:
        proc = subprocess.run(
            [SYSTEM_PYTHON, "-c", code],
            user=65534,
            group=65534,
            cwd="/",
            capture_output=True,
            timeout=30,
        )
        assert proc.returncode == 13, proc.stderr
        assert adopted == []
    finally:
        host.close()
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.integration
def test_a_host_that_cannot_reach_etcd_for_a_ttl_counts_its_lease_lost(
    stores: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd gone for good (stopped under a host, as when a benchmark's platform is torn
    down): every refresh fails; after a TTL without one the host counts its lease lost and
    `run` stops every guardian (EVICTED) instead of guarding on, alone, forever."""

    def make_config(job_id: str, env: dict[str, str]) -> GuardianConfig:
        return GuardianConfig(job_id, stores["etcd_url"], stores["mongo_url"], tmp_path)

    host = GuardianHost(
        HostConfig("cut-off", lease_ttl_s=2, poll_s=0.2),
        stores["etcd"],
        stores["repo"],
        SimulatedBackend(),
        make_config,
    ).start()
    assert host.lease is not None
    job_id = submit(
        stores["repo"], tmp_path, "simulated", env={"SIM_UNTIL_FILE": str(tmp_path / "never")}
    ).job_id
    assert host.adopt(job_id)  # a host with a guardian: it would run on without etcd
    failures: list[int] = []

    def unreachable() -> bool:
        failures.append(1)
        raise StoreUnavailable("etcd at 127.0.0.1 is unreachable (test)")

    monkeypatch.setattr(host.lease, "refresh", unreachable)
    try:
        ended: list[int] = []
        runs = threading.Thread(target=lambda: ended.append(host.run(None)), daemon=True)
        runs.start()
        runs.join(60)  # bounded: without the lost lease it would run on forever
        assert ended == [ExitCode.EVICTED]
        assert host.lease.lost.is_set() and len(failures) >= 2
    finally:
        host.close()
        (tmp_path / "never").touch()
