"""The learner controller learns that its command ended from the exit itself (a thread
blocked in waitid on it), not from polling /proc (issue #16): with the safety poll made
longer than the test's timeout, a command that ends is still seen at once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from contract.learner_spec import LearnerSpec
from learner.controller import controller as controller_module
from learner.controller.controller import Controller

NEVER_S = 3600.0  # a safety poll that never comes within the test


def test_the_commands_exit_wakes_wait_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(controller_module, "COMMAND_SAFETY_S", NEVER_S)
    spec = LearnerSpec(
        job_id="job-exit",
        rank=0,
        world_size=1,
        job_dir=str(tmp_path / "job"),
        command="sleep 0.3; exit 7",
        etcd_url="http://127.0.0.1:1",  # never asked: only spawn and wait_command run
    )
    spec.learner_dir.mkdir(parents=True)
    spec.code_dir.mkdir(parents=True)
    controller = Controller(spec, etcd=None)  # type: ignore[arg-type]
    controller.reaper.start()
    try:
        ref = controller.spawn()
        got: list[int | None] = []
        waiter = threading.Thread(target=lambda: got.append(controller.wait_command(ref)))
        waiter.start()
        waiter.join(60)  # far below NEVER_S: only the exit's wake-up ends the wait here
        assert got == [7]
    finally:
        controller.halt.set()
        controller.wake.set()
        controller.reaper.stop()
