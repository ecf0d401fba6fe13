"""A controller whose etcd lease lapsed while it lived (its keep-alive starved on a busy
machine, etcd away for longer than the TTL) never acts beside a successor for its rank:
it takes the rank back with a new lease if nobody has, and otherwise leaves at once
without touching the command or writing its status over the successor's. Runs
`python -m learner.controller` against the session's real etcd; the lapse is made by
revoking the controller's lease from outside, which is what its expiry does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from contract import etcd_keys, procs
from contract.etcd import Entry, EtcdClient
from contract.learner_spec import LearnerSpec
from contract.procs import stop_process_group
from contract.status import ExitCode
from services.embedded.process import ManagedServer
from tests.services.guardian.helpers import wait_for

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.integration


class Running:
    """One controller process for rank 0 of a fresh job, its command waiting until the
    test lets it end (`release`): the checks on a running command never race its end."""

    def __init__(self, etcd_url: str, tmp_path: Path) -> None:
        self.go = tmp_path / "go"
        self.spec = LearnerSpec(
            job_id=f"jfence{uuid.uuid4().hex[:8]}",
            rank=0,
            world_size=1,
            job_dir=str(tmp_path / "job"),
            command=f"while [ ! -e {self.go} ]; do sleep 0.05; done",
            etcd_url=etcd_url,
            lease_ttl_s=2,  # keep-alive every 0.5 s: a lapse is noticed within it
        )
        path = self.spec.learner_dir / "spec.json"
        self.spec.dump(path)
        self.etcd = EtcdClient.connect(etcd_url)
        self.key = etcd_keys.learner_status(self.spec.job_id, 0)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "learner.controller", "--spec", str(path)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def entry(self) -> Entry | None:
        return self.etcd.get(self.key)

    def processing(self) -> Entry:
        def check() -> Entry | None:
            entry = self.entry()
            return entry if entry and entry.value.get("status") == "PROCESSING" else None

        return wait_for("the learner to be PROCESSING", check, 20)

    def command(self) -> procs.ProcRef:
        """The running command (PROCESSING is recorded just before it is spawned)."""

        def spawned() -> procs.ProcRef | None:
            state = json.loads((self.spec.learner_dir / "controller.json").read_text())
            if "cmd_pid" not in state:
                return None
            return procs.ProcRef(int(state["cmd_pid"]), int(state["cmd_start"]))

        return wait_for("the command to be spawned", spawned, 20)

    def release(self) -> None:
        self.go.touch()

    def close(self) -> None:
        stop_process_group(self.proc.pid)
        self.etcd.delete_prefix(etcd_keys.learner_prefix(self.spec.job_id))
        self.etcd.close()


@pytest.fixture
def running(etcd_server: ManagedServer, tmp_path: Path) -> Iterator[Callable[[], Running]]:
    made: list[Running] = []

    def start() -> Running:
        made.append(Running(str(etcd_server.url), tmp_path / str(len(made))))
        return made[-1]

    yield start
    for run in made:
        run.close()


def test_a_lapsed_controller_takes_its_rank_back_when_nobody_has(
    running: Callable[[], Running],
) -> None:
    run = running()
    before = run.processing()
    command = run.command()
    run.etcd.revoke(before.lease)  # what the lease's expiry does: the key goes with it
    assert run.entry() is None or run.entry().lease != before.lease  # type: ignore[union-attr]

    def regained() -> Entry | None:
        entry = run.entry()
        return entry if entry and entry.lease and entry.lease != before.lease else None

    again = wait_for("the controller to hold its rank again", regained, 20)
    assert again.value["pid"] == before.value["pid"]  # the same controller, a new lease
    assert again.value["status"] == "PROCESSING"
    assert command.alive(), "regaining the rank must not touch the running command"
    run.release()
    assert run.proc.wait(timeout=30) == 0, run.proc.stderr.read() if run.proc.stderr else ""
    final = run.entry()
    assert final is not None and final.value["status"] == "COMPLETED" and final.lease == 0


def test_a_lapsed_controller_leaves_a_successor_its_rank_and_command(
    running: Callable[[], Running],
) -> None:
    run = running()
    before = run.processing()
    command = run.command()
    successor = run.etcd.grant(30).keep_alive()
    try:
        # A successor took the rank between the lapse and the old controller's next
        # keep-alive: the key is put under the successor's lease in one write (so the
        # old one cannot win it back first), then the old lease is gone.
        theirs = {"status": "PROCESSING", "pid": os.getpid(), "successor": True}
        run.etcd.put(run.key, theirs, lease=successor)
        run.etcd.revoke(before.lease)
        code = run.proc.wait(timeout=20)
        stderr = run.proc.stderr.read() if run.proc.stderr else ""
        assert code == ExitCode.FATAL, stderr  # another live controller holds this rank
        assert "another controller holds the rank" in stderr
        assert command.alive(), "the successor adopts the command: the old one leaves it"
        run.release()
        wait_for("the command to end", lambda: not command.alive(), 30)
        time.sleep(1.0)  # anything the old controller were still to write would be here
        entry = run.entry()
        assert entry is not None and entry.value == theirs and entry.lease == successor.id
    finally:
        successor.revoke()
