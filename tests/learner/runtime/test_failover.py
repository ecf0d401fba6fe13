"""Multi-process runs through the launcher, with real SIGKILLs, against a real etcd.

Each worker that is told to (``--kill worker:step:op[:microbatch]``) SIGKILLs itself
right before that instruction: a real preemption at a controlled instant. One test kills
a worker from outside at whatever instant it happens to be in. Each run must end with
the parameters of the uninterrupted single-process reference (allclose, float64).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from learner.runtime.reference import reference_train
from learner.runtime.toy import toy_job
from services.embedded.process import ManagedServer

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
TOY = REPO / "learner" / "runtime" / "toy.py"


def launcher_argv(
    etcd: ManagedServer,
    out: Path,
    stages: int,
    pipelines: int,
    steps: int,
    kill: str = "",
    *,
    detection_timeout_s: int = 10,
    launcher_args: Sequence[str] = (),
    toy_args: Sequence[str] = (),
) -> list[str]:
    """The launcher running the toy job for ``steps`` steps as a fresh job; the launcher's
    own further options (``launcher_args``) go before the script, the toy's (``toy_args``,
    e.g. ``--gate``) after it."""
    return [
        sys.executable,
        "-m",
        "learner.runtime.launch",
        "--stages",
        str(stages),
        "--pipelines",
        str(pipelines),
        "--etcd",
        etcd.url,
        "--job-id",
        f"t-{uuid.uuid4().hex[:10]}",
        "--detection-timeout",
        str(detection_timeout_s),
        "--out-dir",
        str(out),
        *(["--kill", kill] if kill else []),
        *launcher_args,
        str(TOY),
        "--steps",
        str(steps),
        *toy_args,
    ]


def launch(
    etcd: ManagedServer, tmp: Path, stages: int, pipelines: int, steps: int, kill: str = ""
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        launcher_argv(etcd, tmp / "params", stages, pipelines, steps, kill),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )


def saved_params(out: Path) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("worker*.pt")):
        for key, value in torch.load(f).items():
            if key in merged:  # another pipeline's copy must be identical
                assert torch.equal(merged[key], value), key
            merged[key] = value
    return merged


def assert_equals_reference(out: Path, pipelines: int, steps: int) -> None:
    got = saved_params(out)
    ref = reference_train(toy_job(steps=steps), pipelines)
    assert set(got) == set(ref)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-9, atol=1e-11, msg=key)


def assert_survived(proc: subprocess.CompletedProcess[str], victim: int, steps: int) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"worker {victim} killed by signal 9" in proc.stderr
    assert re.search(r"joined generation 1 .*resume at step", proc.stderr), proc.stderr[-3000:]
    # every step reported once in the end, the last after the failover
    assert f"step {steps - 1} loss" in proc.stdout
    assert "generation 1" in proc.stdout.splitlines()[-1]


def test_no_failure_multiprocess_two_pipelines(etcd_server: ManagedServer, tmp_path: Path) -> None:
    proc = launch(etcd_server, tmp_path, stages=2, pipelines=2, steps=3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_equals_reference(tmp_path / "params", pipelines=2, steps=3)


@pytest.mark.parametrize(
    "stages,pipelines,kill,victim,progress_kept",
    [
        pytest.param(3, 1, "1:1:forward:1", 1, False, id="middle-stage-during-forward"),
        pytest.param(3, 1, "1:1:backward:0", 1, True, id="middle-stage-during-backward"),
        pytest.param(3, 1, "0:1:forward:2", 0, False, id="first-stage"),
        pytest.param(3, 1, "2:1:backward:1", 2, False, id="last-stage"),
        pytest.param(2, 2, "1:1:allreduce", 1, True, id="allreduce-pending-in-other-pipeline"),
    ],
)
def test_sigkill_fails_over_without_restart(
    etcd_server: ManagedServer,
    tmp_path: Path,
    stages: int,
    pipelines: int,
    kill: str,
    victim: int,
    progress_kept: bool,
) -> None:
    proc = launch(etcd_server, tmp_path, stages, pipelines, steps=3, kill=kill)
    assert_survived(proc, victim, steps=3)
    assert_equals_reference(tmp_path / "params", pipelines=pipelines, steps=3)
    shadow = (victim - 1) % stages + (victim // stages) * stages
    assert f"[worker {shadow}] promoted replica of block {victim % stages}" in proc.stderr
    left = [int(n) for n in re.findall(r"pipeline \d+: (\d+) forwards", proc.stderr)]
    assert left, proc.stderr[-3000:]  # every survivor planned what was left of the step
    if progress_kept:
        # The survivors had finished work of the step before the kill could happen (the
        # victim was about to use the successor's gradient of microbatch 0, or had
        # finished its microbatches): the step goes on from there, not from its start.
        # Where the kill can land before any survivor did anything, the whole step is
        # legitimately left, so the other cases do not check this.
        assert max(left) < stages * 3, proc.stderr[-3000:]  # toy: 3 microbatches


def test_a_stage_lost_at_the_all_reduce_replays_only_its_backwards(
    etcd_server: ManagedServer, tmp_path: Path
) -> None:
    # Every microbatch had gone through the victim: its shadow runs the backward over its
    # eager-FRC graphs (lazy BRC) and nothing else; the other pipeline only re-runs the
    # all-reduce. (Block 0 may still owe its last backward when the kill lands: 3 or 4.)
    proc = launch(etcd_server, tmp_path, 2, 2, steps=3, kill="1:1:allreduce")
    assert_survived(proc, 1, steps=3)
    plan0 = r"\[worker 0\] joined .*pipeline 0: 0 forwards, [34] backwards"
    assert re.search(plan0, proc.stderr), proc.stderr[-3000:]
    assert re.search(r"\[worker 3\] joined .*pipeline 1: nothing left to compute", proc.stderr)
    assert_equals_reference(tmp_path / "params", pipelines=2, steps=3)


@pytest.mark.parametrize("victim", [0, 1], ids=["first-stage", "last-stage"])
def test_a_worker_lost_while_generation_0_links_fails_over(
    etcd_server: ManagedServer, tmp_path: Path, victim: int
) -> None:
    """Every worker registered, then one dies before its links are built: its peer, waiting
    for that link, fails over to its shadow as within a step (it used to exit with
    'configuration changed while waiting for link to worker 1 of generation 0')."""
    proc = launch(etcd_server, tmp_path, 2, 1, steps=3, kill=f"{victim}:0:link")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"worker {victim} killed by signal 9" in proc.stderr
    survivor = 1 - victim
    assert f"[worker {survivor}] forming generation 0:" in proc.stderr, proc.stderr[-3000:]
    assert f"[worker {survivor}] promoted replica of block {victim}" in proc.stderr
    assert "generation 1" in proc.stdout.splitlines()[-1]
    assert_equals_reference(tmp_path / "params", pipelines=1, steps=3)


def follow_worker_pids(
    proc: subprocess.Popen[str],
) -> tuple[dict[int, int], list[str], threading.Thread]:
    """Read the launcher's stderr on a thread: its lines, and each worker's pid as the
    launcher names it (`rhizome-runtime: worker W pid P`), filled in as they come."""
    pids: dict[int, int] = {}
    lines: list[str] = []

    def read_err() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            m = re.match(r"rhizome-runtime: worker (\d+) pid (\d+)", line)
            if m:
                pids[int(m.group(1))] = int(m.group(2))

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    return pids, lines, reader


def test_sigkill_from_outside_at_any_instant(etcd_server: ManagedServer, tmp_path: Path) -> None:
    steps = 25
    argv = launcher_argv(etcd_server, tmp_path / "params", 2, 1, steps)
    proc = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    pids, err_lines, reader = follow_worker_pids(proc)
    out_lines: list[str] = []
    assert proc.stdout is not None
    killed = False
    for line in proc.stdout:
        out_lines.append(line)
        if not killed and line.startswith("step 2 "):
            os.kill(pids[1], signal.SIGKILL)
            killed = True
    proc.wait(timeout=240)
    reader.join(timeout=10)
    stderr = "".join(err_lines)
    assert killed
    assert proc.returncode == 0, stderr[-3000:]
    assert "worker 1 killed by signal 9" in stderr
    assert f"step {steps - 1} loss" in "".join(out_lines)
    assert_equals_reference(tmp_path / "params", pipelines=1, steps=steps)


def test_a_silent_worker_is_found_by_its_lease_through_the_watch(
    etcd_server: ManagedServer, tmp_path: Path
) -> None:
    """A SIGSTOPped worker breaks no link (its sockets stay open, gloo waits up to the
    10 s detection timeout): only its lease lapses. Its peer must learn of that from the
    etcd watch (the deletion of ``members/1``; nothing polls etcd), declare it dead for
    that reason, fail over and finish with the reference's parameters."""
    steps = 25
    argv = launcher_argv(etcd_server, tmp_path / "params", 2, 1, steps)
    proc = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    pids, err_lines, reader = follow_worker_pids(proc)
    stopped = threading.Event()

    def kill_once_replaced() -> None:
        # the stopped worker can never leave by itself: SIGKILL it once its peer took
        # over (or after a minute, so a failing run still ends)
        stopped.wait(120)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any("joined generation 1" in line for line in err_lines):
                break
            time.sleep(0.1)
        os.kill(pids[1], signal.SIGKILL)

    killer = threading.Thread(target=kill_once_replaced, daemon=True)
    killer.start()
    out_lines: list[str] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            out_lines.append(line)
            if not stopped.is_set() and line.startswith("step 2 "):
                os.kill(pids[1], signal.SIGSTOP)
                stopped.set()
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    killer.join(timeout=70)
    reader.join(timeout=10)
    stderr = "".join(err_lines)
    assert stopped.is_set()
    assert proc.returncode == 0, stderr[-3000:]
    assert "declared worker 1 dead (etcd lease expired)" in stderr, stderr[-3000:]
    assert f"step {steps - 1} loss" in "".join(out_lines)
    assert "generation 1" in out_lines[-1]
    assert_equals_reference(tmp_path / "params", pipelines=1, steps=steps)


def test_two_consecutive_stages_lost_is_fatal_with_a_clear_error(
    etcd_server: ManagedServer, tmp_path: Path
) -> None:
    proc = launch(etcd_server, tmp_path, 3, 1, steps=3, kill="1:1:forward:1,2:1:forward:0")
    assert proc.returncode == 3, proc.stderr[-3000:]
    fatal = [
        line for line in proc.stderr.splitlines() if line.startswith("rhizome-runtime: fatal:")
    ]
    assert len(fatal) == 1
    assert "lost consecutive stages 1 and 2" in fatal[0]
    assert "restart from the latest checkpoint" in fatal[0]
