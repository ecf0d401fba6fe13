"""The replica's updates applied on one kept thread per worker (``replica_update``, issue #24).

Unit tests of ``ReplicaUpdater`` (order, the epoch fence, errors, one thread), and a
launched run where a worker is SIGKILLed while its shadow is still applying the replica's
update in the background: the join waits for it, and the run ends with the reference's
parameters.
"""

from __future__ import annotations

import re
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from learner.runtime.api import RedundancyMode
from learner.runtime.replica_update import ReplicaUpdater
from services.embedded.process import ManagedServer
from tests.learner.runtime.test_failover import (
    REPO,
    assert_equals_reference,
    assert_survived,
    launcher_argv,
)


class FakeBlock:
    """Records the steps applied; an apply can be held until the test releases it."""

    def __init__(self, index: int = 1) -> None:
        self.index = index
        self.applied: list[int] = []
        self.started = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.fail_at: int | None = None

    def apply(self, reduced: torch.Tensor, step: int) -> None:
        self.started.set()
        self.release.wait()
        if step == self.fail_at:
            raise RuntimeError(f"step {step} does not apply")
        self.applied.append(step)


def make(epoch: list[int] | None = None) -> tuple[ReplicaUpdater, list[str]]:
    now = epoch if epoch is not None else [0]
    logs: list[str] = []
    return ReplicaUpdater(lambda: now[0], logs.append), logs


def test_updates_apply_in_order_and_settle_waits_for_the_one_in_flight() -> None:
    updater, _ = make()
    block = FakeBlock()
    block.release.clear()
    updater.submit(block, torch.zeros(1), 0, 0)
    updater.submit(block, torch.zeros(1), 1, 0)
    assert block.started.wait(30)  # the first is being applied now
    settled = threading.Event()

    def settle() -> None:
        updater.settle()
        settled.set()

    waiter = threading.Thread(target=settle)
    waiter.start()
    # settle cannot return while an update is held in apply (no timing: it must not
    # return at all before the release)
    assert not settled.wait(0.2)
    assert updater.pending()
    block.release.set()
    waiter.join(30)
    assert settled.is_set()
    assert block.applied == [0, 1]
    assert not updater.pending()
    updater.close()


def test_with_when_idle_an_update_starts_only_in_a_wait_of_the_step_or_a_settle() -> None:
    """The worker's updater (``when_idle``) leaves the next step's first forwards alone:
    an update handed over starts only once a step thread waits for a message (``idle``)
    or something settles it (no timing: without either it must never start)."""
    updater = ReplicaUpdater(lambda: 0, lambda _: None, when_idle=True)
    block = FakeBlock()
    updater.submit(block, torch.zeros(1), 0, 0)
    assert not block.started.wait(0.2)
    assert updater.pending()
    with updater.idle():
        assert block.started.wait(30)
    updater.settle()
    assert block.applied == [0]
    block.started.clear()
    updater.submit(block, torch.zeros(1), 1, 0)
    assert not block.started.wait(0.2)
    updater.settle()  # what reads the replica forces it
    assert block.applied == [0, 1]
    updater.close()


def test_a_task_runs_only_in_a_wait_of_the_step_or_a_settle_even_without_when_idle() -> None:
    """``submit_task`` (the owned block's snapshot taken ahead of its update): behind the
    updates handed over before it, started only in a wait of the step (``idle``) or by a
    settle, also on an updater that applies updates at once (eager FRC); a task of an
    abandoned epoch is dropped (no timing: without a wait or a settle it must never run)."""
    epoch = [0]
    updater, _ = make(epoch)  # when_idle=False: updates start at once
    block = FakeBlock()
    ran: list[str] = []
    started = threading.Event()

    def task(name: str) -> None:
        ran.append(name)
        started.set()

    updater.submit(block, torch.zeros(1), 0, 0)
    updater.submit_task(lambda: task("a"), 0)
    assert not started.wait(0.2)
    assert block.started.wait(30)  # the update before it started without a wait
    with updater.idle():
        assert started.wait(30)
    assert ran == ["a"]
    started.clear()
    updater.submit_task(lambda: task("b"), 0)
    updater.settle()
    assert ran == ["a", "b"]
    updater.submit_task(lambda: task("c"), 0)
    epoch[0] = 1  # a failover joined before it ran
    updater.settle()
    assert ran == ["a", "b"]
    assert updater.discarded == 0  # a task is not an update
    updater.close()


def test_an_update_of_an_abandoned_epoch_is_discarded_not_applied() -> None:
    epoch = [3]
    updater, logs = make(epoch)
    block = FakeBlock()
    updater.submit(block, torch.zeros(1), 7, 2)  # received before the failover's join
    updater.submit(block, torch.zeros(1), 8, 3)
    updater.settle()
    assert block.applied == [8]
    assert updater.discarded == 1
    assert any("discarded the update of step 7" in line for line in logs)
    updater.close()


def test_an_apply_error_reaches_the_step_loop_and_drops_the_later_updates() -> None:
    updater, _ = make()
    block = FakeBlock()
    block.fail_at = 4
    block.release.clear()
    updater.submit(block, torch.zeros(1), 4, 0)
    updater.submit(block, torch.zeros(1), 5, 0)
    block.release.set()
    with pytest.raises(RuntimeError, match="step 4 does not apply"):
        updater.settle()
    assert block.applied == []  # step 5 builds on step 4: never applied
    updater.settle()  # the error is raised once
    updater.submit(block, torch.zeros(1), 6, 0)
    updater.settle()
    assert block.applied == [6]
    updater.close()


def test_one_thread_for_every_update(monkeypatch: Any) -> None:
    started: list[str] = []
    real_start = threading.Thread.start

    def counting_start(self: threading.Thread) -> None:
        started.append(self.name)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", counting_start)
    updater, _ = make()
    block = FakeBlock()
    for step in range(500):
        updater.submit(block, torch.zeros(1), step, 0)
        if step % 50 == 0:
            updater.settle()
    updater.settle()
    assert block.applied == list(range(500))
    assert started == ["replica-updater"]
    updater.close()


def test_a_failover_while_the_replica_update_is_applied_in_the_background(
    etcd_server: ManagedServer, tmp_path: Path
) -> None:
    """Every optimizer step sleeps 1 s (``toy.py --slow-optimizer``): worker 0 hands the
    update of step 1 of its replica (block 1) to its updater thread and starts step 2;
    worker 1 dies before its first forward of step 2, which worker 0 learns from its link
    within milliseconds, a second before the update is applied. The join must wait for
    it (the replica is at version 2, like worker 0's own block): the run resumes at step
    2 and ends with the uninterrupted reference's parameters. Lazy FRC: an eager FRC would
    wait for the update in step 2's first bubble, before the failure is seen."""
    steps = 4
    argv = launcher_argv(etcd_server, tmp_path / "params", 2, 1, steps, kill="1:2:forward:0")
    argv += [
        "--redundancy",
        RedundancyMode.LAZY_FRC_LAZY_BRC.value,
        "--slow-optimizer",
        "1.0",
    ]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert_survived(proc, 1, steps)
    waited = re.search(
        r"\[worker 0\] joining: waited (\d+\.\d+) s for the replica's update", proc.stderr
    )
    assert waited, proc.stderr[-3000:]
    assert re.search(r"\[worker 0\] joined generation 1 .*resume at step 2", proc.stderr), (
        proc.stderr[-3000:]
    )
    assert "[worker 0] promoted replica of block 1" in proc.stderr
    assert_equals_reference(tmp_path / "params", pipelines=1, steps=steps)


def test_a_loss_in_the_sync_phase_keeps_every_frc_graph(
    etcd_server: ManagedServer, tmp_path: Path
) -> None:
    """Eager FRC (the toy's default): worker 1 dies at its all-reduce of step 1, after
    every microbatch went through it, while worker 0 is in its sync phase: the FRC that
    found no bubble runs there, and the replica's update of step 0 may still be being
    applied on the updater thread. The join settles it before it promotes the replica,
    and every microbatch's FRC graph is there: the shadow runs only the lost block's
    backwards over them (lazy BRC), no forward, and the run ends with the reference's
    parameters."""
    steps = 3
    argv = launcher_argv(etcd_server, tmp_path / "params", 2, 1, steps, kill="1:1:allreduce")
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert_survived(proc, 1, steps)
    assert "[worker 0] promoted replica of block 1" in proc.stderr
    plan = r"\[worker 0\] joined .*resume at step 1; pipeline 0: 0 forwards, [34] backwards"
    assert re.search(plan, proc.stderr), proc.stderr[-3000:]
    assert_equals_reference(tmp_path / "params", pipelines=1, steps=steps)
