"""The preemption injector against real processes."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from services.injector.cli import inject
from services.injector.injector import (
    Injector,
    InjectorError,
    alive,
    exponential_schedule,
    trace_schedule,
)

REPO = Path(__file__).resolve().parents[3]
TRACE = REPO / "tests" / "learner" / "checkpoint" / "fixtures" / "one-removal.csv"

# Leaves on SIGTERM after printing; or ignores it (then only SIGKILL stops it).
POLITE = "import signal,sys,time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\nprint('up', flush=True)\ntime.sleep(60)\n"
STUBBORN = "import signal,time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(60)\n"


def _spawn(code: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    return proc


def test_trace_schedule_scales_the_removals() -> None:
    assert trace_schedule(TRACE) == [0.5]
    assert trace_schedule(TRACE, time_scale=10) == [pytest.approx(0.05)]
    p3 = trace_schedule("aws-p3-64.csv", time_scale=1000)
    assert len(p3) == 167 and p3 == sorted(p3)


def test_exponential_schedule_is_seeded_with_the_given_mean() -> None:
    a = exponential_schedule(10.0, 2000, seed=3)
    assert a == exponential_schedule(10.0, 2000, seed=3)
    gaps = [b - a_ for a_, b in zip([0.0, *a[:-1]], a, strict=True)]
    assert statistics.fmean(gaps) == pytest.approx(10.0, rel=0.1)
    with pytest.raises(InjectorError, match="mttp_s must be > 0"):
        exponential_schedule(0.0, 1)


def test_sigterm_then_sigkill_when_the_notice_runs_out(tmp_path: Path) -> None:
    polite, stubborn = _spawn(POLITE), _spawn(STUBBORN)
    log = tmp_path / "log.jsonl"
    try:
        inj = Injector([polite.pid, stubborn.pid], [0.0, 0.0], notice_s=1.0, log_path=log)
        done = {i.pid: i for i in inj.run()}
        assert polite.wait(timeout=30) == 143
        assert stubborn.wait(timeout=30) == -9
    finally:
        for p in (polite, stubborn):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert done[polite.pid].events == ["sigterm"] and done[polite.pid].outcome == "exited"
    assert done[stubborn.pid].events == ["sigterm", "sigkill"]
    assert done[stubborn.pid].outcome == "killed"
    assert len(log.read_text().splitlines()) == 2
    assert not alive(stubborn.pid)


def test_no_targets_left_ends_the_replay() -> None:
    proc = _spawn(POLITE)
    try:
        done = Injector([proc.pid], [0.0, 0.1, 0.2], notice_s=5.0).run()
    finally:
        proc.wait(timeout=30)
    assert len(done) == 1


def test_cli_needs_one_schedule_and_a_pid() -> None:
    runner = CliRunner()
    both = runner.invoke(inject, ["--pid", "1", "--trace", str(TRACE), "--mttp", "5"])
    assert both.exit_code == 2 and "exactly one of --trace" in both.output
    nopid = runner.invoke(inject, ["--mttp", "5"])
    assert nopid.exit_code == 2 and "--pid" in nopid.output
    missing = runner.invoke(inject, ["--pid", "1", "--trace", "nope.csv"])
    assert missing.exit_code == 2 and "not found" in missing.output


def test_cli_json_reports_each_preemption() -> None:
    proc = _spawn(POLITE)
    try:
        result = CliRunner().invoke(
            inject, ["--pid", str(proc.pid), "--mttp", "0.01", "--notice", "5", "--json"]
        )
    finally:
        proc.wait(timeout=30)
    assert result.exit_code == 0, result.output
    (one,) = json.loads(result.output)
    assert one["pid"] == proc.pid and one["outcome"] == "exited"


def test_job_schedule_keeps_each_removal_with_the_simulators_probability() -> None:
    every = trace_schedule("aws-p3-64.csv", time_scale=1000)
    one = trace_schedule("aws-p3-64.csv", time_scale=1000, job_nodes=1, seed=0)
    assert one == trace_schedule("aws-p3-64.csv", time_scale=1000, job_nodes=1, seed=0)
    assert set(one) < set(every) and 0 < len(one) < len(every)
    # A job as big as the trace's largest cluster is hit by every removal.
    assert trace_schedule("aws-p3-64.csv", time_scale=1000, job_nodes=64) == every
    with pytest.raises(InjectorError, match="job_nodes must be >= 1"):
        trace_schedule(TRACE, job_nodes=0)
