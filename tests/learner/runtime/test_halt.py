"""A preemption notice in pipeline workers (learner/runtime/halt.py), through the launcher
with a real etcd and real SIGTERMs: a halt (every worker) saves at one agreed step and
the next run resumes there with no step lost; a notice for one worker makes it leave and
its peers fail over at once."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from contract.checkpoints import MARK
from contract.status import ExitCode
from learner.runtime import block_checkpoint
from services.embedded.process import ManagedServer
from tests.learner.runtime.test_failover import (
    REPO,
    assert_equals_reference,
    follow_worker_pids,
    launcher_argv,
)

pytestmark = pytest.mark.integration

STEPS = 40


def _argv(
    etcd: ManagedServer,
    tmp: Path,
    stages: int,
    extra: list[str],
    every: int = 5,
    pipelines: int = 1,
) -> list[str]:
    """The toy job checkpointing every ``every`` steps; ``extra`` are the toy's options."""
    return launcher_argv(
        etcd,
        tmp / "params",
        stages,
        pipelines,
        STEPS,
        launcher_args=["--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-every", str(every)],
        toy_args=extra,
    )


def _run_and_signal(
    argv: list[str], at_step: int, workers: list[int], env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """Run the launcher; SIGTERM ``workers`` once the step line of ``at_step`` shows."""
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RHIZOME_GRACE_S": "60", **(env or {})},
    )
    pids, err, reader = follow_worker_pids(proc)
    out: list[str] = []
    assert proc.stdout is not None
    signalled = False
    for line in proc.stdout:
        out.append(line)
        if not signalled and line.startswith(f"step {at_step} "):
            for w in workers:
                os.kill(pids[w], signal.SIGTERM)
            signalled = True
    proc.wait(timeout=240)
    reader.join(timeout=10)
    assert signalled, "".join(err)[-3000:]
    return proc.returncode, "".join(out), "".join(err)


def _reports(stderr: str) -> list[dict[str, object]]:
    return [json.loads(line[len(MARK) :]) for line in stderr.splitlines() if line.startswith(MARK)]


@pytest.mark.parametrize("pipelines", [1, 2])
def test_a_halt_saves_every_block_at_one_step_and_the_next_run_resumes_there(
    etcd_server: ManagedServer, tmp_path: Path, pipelines: int
) -> None:
    workers = list(range(2 * pipelines))
    argv = _argv(etcd_server, tmp_path, 2, ["--sleep", "0.03"], pipelines=pipelines)
    code, _, err = _run_and_signal(argv, at_step=7, workers=workers)
    assert code == ExitCode.PREEMPTED, err[-3000:]
    assert err.count("left on a preemption notice") == len(workers), err[-3000:]
    reports = _reports(err)
    assert sorted(str(r["learner"]) for r in reports) == [str(w) for w in workers], err[-3000:]
    assert {r["kind"] for r in reports} == {"emergency"}
    steps = {int(str(r["step"])) for r in reports}
    assert len(steps) == 1, reports  # one agreed step
    s = steps.pop()
    # past the last periodic save (step 5) and the step the notice came in
    assert 7 < s < STEPS, err[-3000:]
    assert block_checkpoint.latest_complete(str(tmp_path / "ckpt"), 2) == s
    assert not (tmp_path / "params").exists()  # it left; it did not finish

    # the next run (a fresh job id, the same checkpoint directory) starts at s: no step
    # lost, and ends where an uninterrupted run ends
    again = subprocess.run(
        _argv(etcd_server, tmp_path, 2, [], pipelines=pipelines),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"from the checkpoint of step {s}" in again.stderr
    assert f"step {s} loss" in again.stdout.splitlines()[0]
    assert_equals_reference(tmp_path / "params", pipelines=pipelines, steps=STEPS)


def test_a_notice_for_one_worker_makes_it_leave_and_its_peers_fail_over(
    etcd_server: ManagedServer, tmp_path: Path
) -> None:
    argv = _argv(etcd_server, tmp_path, 3, ["--sleep", "0.02"])
    code, out, err = _run_and_signal(argv, at_step=4, workers=[1])
    assert code == 0, err[-3000:]
    assert "worker 1 left on a preemption notice" in err
    assert "notice for this worker alone" in err
    # declared dead by itself, not by a peer's detection timeout or lease expiry
    assert re.search(r"declared worker 1 dead \(left on a sigterm preemption notice", err), err[
        -3000:
    ]
    assert "generation 1" in out.splitlines()[-1]
    assert not _reports(err)  # it did not save alone
    assert_equals_reference(tmp_path / "params", pipelines=1, steps=STEPS)


def test_a_halt_whose_save_cannot_fit_in_the_grace_says_so_and_leaves(
    etcd_server: ManagedServer, tmp_path: Path
) -> None:
    # no periodic save to measure, so the checkpoint layer's prior (RHIZOME_SAVE_S) is the
    # save's duration: 20 s do not fit in an 8 s grace (policy.emergency_save_fits)
    argv = _argv(etcd_server, tmp_path, 2, ["--sleep", "0.03"], every=0)
    code, _, err = _run_and_signal(
        argv, at_step=3, workers=[0, 1], env={"RHIZOME_GRACE_S": "8", "RHIZOME_SAVE_S": "20"}
    )
    assert code == ExitCode.PREEMPTED, err[-3000:]
    assert err.count("does not fit in the") == 2, err[-3000:]
    assert "the resume uses the start (no checkpoint)" in err
    assert not _reports(err)
    assert block_checkpoint.latest_complete(str(tmp_path / "ckpt"), 2) is None
