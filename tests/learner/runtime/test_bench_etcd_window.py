"""runtime_vs_torch's steady etcd figure leaves a run's start-up and finish out (issue #24).

No servers: the benchmark's ``summarize`` on made-up step ends and an etcd CPU counter
that burns a burst at start-up and at the finish and a slow, constant rate in between.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "runtime_vs_torch", REPO / "benchmarks" / "runtime_vs_torch.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STEADY_RATE = 0.004  # of a core, between start-up and finish
BURST_S = 0.5  # CPU seconds etcd burns at start-up and again at the finish
STEPS = 20
STEP_S = 0.1


def _counter(t: float, start: float, finish: float) -> float:
    """etcd's CPU seconds at time ``t``: a burst just after ``start`` (leases, watches,
    rendezvous) and just after ``finish`` (``done/`` keys), ``STEADY_RATE`` throughout."""
    burst = BURST_S * (min(max(t - start, 0.0), 0.1) / 0.1)
    burst += BURST_S * (min(max(t - finish, 0.0), 0.1) / 0.1)
    return STEADY_RATE * t + burst


def _fake_run(bench: ModuleType, t0: float) -> tuple[dict[str, Any], Any]:
    # the run's first step ends after start-up; its last step's end is where finishing
    # may begin (a peer that ended it puts its done/ key)
    ends = [t0 + 0.15 + STEP_S * (i + 1) for i in range(STEPS)]
    sampler = object.__new__(bench.CpuSampler)
    start, finish = t0 + 0.05, ends[-2] + 0.01
    sampler.samples = [
        (t, _counter(t, start, finish), _counter(t, start, finish))
        for t in (t0 + 0.01 * i for i in range(int((ends[-1] - t0) / 0.01) + 20))
    ]
    rec = {
        "worker": 1,
        "mode": "rz-none",
        "rep": 0,
        "times": [STEP_S] * STEPS,
        "ends": ends,
        "cpu": [0.05 * (i + 1) for i in range(STEPS)],
        "losses": [1.0] * STEPS,
        "frc": None,
    }
    return rec, sampler


def test_the_steady_window_leaves_start_up_and_finish_out(bench: ModuleType) -> None:
    rec, sampler = _fake_run(bench, 100.0)
    worker0 = {**rec, "worker": 0}
    idle = {"before": {"window_s": 10.0, "cpu_s": 0.02, "cores": 0.002}}
    got = bench.summarize([worker0, rec], ["rz-none"], 2, sampler, 5, idle)
    row = got["modes"]["rz-none"]
    assert row["etcd_steady_cpu_cores"] == pytest.approx(STEADY_RATE, rel=1e-6)
    # steps 5 .. STEPS-2: from the end of step 4 to the end of the last-but-one step
    assert row["etcd_steady_window_s"] == pytest.approx((STEPS - 2 - 4) * STEP_S)
    # the earlier column runs to the end of the run and so takes in the finish's burst
    assert row["etcd_cpu_cores"] > 10 * STEADY_RATE
    assert got["steady_from_step"] == 5
    assert got["etcd_idle_cpu_cores"] == pytest.approx(0.002)


def test_the_steady_window_starts_past_the_warm_up(bench: ModuleType) -> None:
    class Args:
        steps = 40
        steady_from: int | None = None

    assert bench.steady_from(Args()) == 10
    Args.steady_from = 1
    assert bench.steady_from(Args()) == bench.WARM + 1
    Args.steps, Args.steady_from = 5, None
    assert bench.steady_from(Args()) == 3  # a 5-step smoke run: one step, never empty


def test_pinned_the_floor_is_the_busiest_workers_cpu_per_step(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """With ``--pin`` each worker has one core: no schedule runs a step faster than the
    busiest worker's CPU per step (not the workers' CPU spread over every core)."""
    rec, sampler = _fake_run(bench, 100.0)  # worker 1: 50 ms of CPU per step
    worker0 = {**rec, "worker": 0, "cpu": [0.08 * (i + 1) for i in range(STEPS)]}
    got = bench.summarize([worker0, rec], ["rz-none"], 2, sampler, 5, {})
    row = got["modes"]["rz-none"]
    assert row["cpu_ms_per_step_worker"] == {
        "worker0": pytest.approx(80.0),
        "worker1": pytest.approx(50.0),
    }

    class Args:
        stages, steps, reps, model, pin, backend = 2, STEPS, 1, "gpt", True, "gloo"

    bench.report(got, Args())
    out = capsys.readouterr().out
    assert "on one core per worker (pinned) no schedule runs a step in under 80.0 ms" in out


def test_pinned_workers_get_cpus_of_distinct_physical_cores(bench: ModuleType) -> None:
    """``--pin`` on a machine with hyper-threads: two stages never share a physical core
    while there are enough (siblings listed as the kernel does, ``0,8`` or ``0-1``)."""

    def pairs_apart(cpu: int) -> str:  # cpu k and k+8 share a core
        return f"{cpu % 8},{cpu % 8 + 8}"

    def pairs_adjacent(cpu: int) -> str:  # cpu 2k and 2k+1 share a core
        return f"{cpu - cpu % 2}-{cpu - cpu % 2 + 1}"

    cpus = list(range(16))
    assert bench.pin_cpus(4, cpus, pairs_apart) == [0, 1, 2, 3]
    assert bench.pin_cpus(4, cpus, pairs_adjacent) == [0, 2, 4, 6]
    assert bench.pin_cpus(2, [0, 1], pairs_adjacent) == [0, 1]  # one core: both threads
    assert bench.pin_cpus(3, [0, 1], str) == [0, 1, 0]  # more workers than CPUs
