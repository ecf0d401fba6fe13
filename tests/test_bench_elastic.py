"""The arithmetic of benchmarks/elastic_scaling.py (stall, windows, samples in a span,
steady rates, the ideal and the ratios), on synthetic step logs shaped like the elastic
workers' `sample_log` lines: no processes, no etcd."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "elastic_scaling.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("elastic_scaling_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def step(n: int, t: float, workers: int, gen: int = 1, job: str = "j", batch: int = 8) -> Any:
    """A committed step's log line: `workers` workers of `batch` samples each."""
    samples = {
        f"w{i}": list(range(n * 100 + i * batch, n * 100 + (i + 1) * batch)) for i in range(workers)
    }
    return {"worker": "w0", "time": t, "step": n, "generation": gen, "job": job, "samples": samples}


def test_stall_is_the_gap_minus_the_median_interval_in_seconds_and_iterations(
    bench: ModuleType,
) -> None:
    # steps 0..9 every 0.1 s, then 1.3 s to step 10: 1.2 s lost = 12 iterations
    times = {s: 0.1 * s for s in range(10)} | {10: 0.9 + 1.3, 11: 2.3}
    seconds, iterations = bench.stall(times, 9)
    assert seconds == pytest.approx(1.2)
    assert iterations == pytest.approx(12.0)
    # only the 10 steps up to the change count: a slow start long before does not
    times = {0: 0.0, 1: 5.0} | {s: 5.0 + 0.2 * (s - 1) for s in range(2, 14)} | {14: 7.4 + 0.2}
    seconds, iterations = bench.stall(times, 13)
    assert seconds == pytest.approx(0.0, abs=1e-9)
    assert iterations == pytest.approx(0.0, abs=1e-9)


def test_committed_keeps_the_earliest_record_of_a_step_and_skips_redone_lines(
    bench: ModuleType,
) -> None:
    recs = [
        step(0, 1.0, 2),
        {**step(0, 0.9, 2), "worker": "w1"},
        {"worker": "w1", "redone": [1, 2], "step": 1, "epoch": 0, "reason": "peer died"},
        step(1, 2.0, 4),
    ]
    assert [(r["step"], r["time"]) for r in bench.committed(recs)] == [(0, 0.9), (1, 2.0)]
    assert bench.step_times(recs) == {0: 0.9, 1: 2.0}
    assert bench.first_step_of_width(recs, 4) == 1
    assert bench.first_step_of_width(recs, 2, after=0) is None
    assert bench.n_samples(recs[3]) == 32


def test_windows_are_centred_in_whole_periods_and_bad_ones_refused(bench: ModuleType) -> None:
    assert bench.windows(80, 40, 10) == [(15.0, 25.0), (55.0, 65.0)]
    assert bench.windows(90, 40, 30) == [(5.0, 35.0), (45.0, 75.0)]  # the half period left out
    with pytest.raises(ValueError, match="shorter than its period"):
        bench.windows(80, 40, 40)


def test_samples_in_counts_the_steps_committed_inside_the_span(bench: ModuleType) -> None:
    recs = [step(s, float(s), 2 if s < 5 else 4) for s in range(10)]
    # steps 2, 3, 4 (16 each) and 5, 6 (32 each); 7.0 is outside [2, 7)
    assert bench.samples_in(recs, 2.0, 7.0) == 3 * 16 + 2 * 32


def test_sample_rates_use_steady_steps_of_one_job_and_generation(bench: ModuleType) -> None:
    run_a = [step(s, 0.1 * s, 2) for s in range(6)]  # 16 samples per 0.1 s: 160/s
    # a re-form (generation 2) after a 3 s pause, then 4 workers every 0.125 s: 256/s
    run_a += [step(6 + s, 3.5 + 0.125 * s, 4, gen=2) for s in range(6)]
    # another run (its step numbers overlap run_a's): a stop-resume restarted as a new job
    # every 10 s, one step each, with the same generation number and width: restarts are
    # not steady intervals (counted, they would be the median)
    run_b = [step(s, 100 + 10.0 * s, 2, job=f"b{s}") for s in range(7)]
    rates = bench.sample_rates([run_a, run_b])
    assert rates == {2: pytest.approx(160.0), 4: pytest.approx(256.0)}


def test_ideal_and_the_table_ratios_and_verdicts(bench: ModuleType) -> None:
    # 1,000 samples in 100 s at 2 workers; extras for 2 x 10 s at a 1.6x speedup:
    # 10/s x (80 s + 1.6 x 20 s) = 1,120
    ideal = bench.ideal_samples(1000, 100.0, [(10.0, 20.0), (60.0, 70.0)], 1.6)
    assert ideal == pytest.approx(1120.0)
    short = bench.Row(5.0, baseline=1000, stop_resume=900, elastic=1100, ideal=ideal)
    assert short.elastic_vs_ideal == pytest.approx(1100 / 1120)
    assert short.stop_resume_vs_baseline == pytest.approx(0.9)
    assert short.verdicts() == (
        "elastic >= 0.97 x ideal: yes; stop-resume < baseline (short window): yes"
    )
    long = bench.Row(30.0, baseline=1000, stop_resume=1050, elastic=1000, ideal=ideal)
    assert long.verdicts() == "elastic >= 0.97 x ideal: no"  # 0.893; no short-window claim
    lines = bench.table([short, long])
    assert lines[0].startswith("W (s) | baseline | stop-resume | elastic | ideal")
    assert "0.982" in lines[1] and "0.900" in lines[1]
    assert "0.893" in lines[2] and "1.050" in lines[2]


def test_a_scale_out_in_two_reforms_counts_both_and_the_steps_between_as_ordinary(
    bench: ModuleType,
) -> None:
    # generation 1 on 2 workers every 0.1 s to step 9 (t=0.9); the first joiner re-forms
    # (0.3 s gap) to 3 workers for steps 10-11, the second (0.4 s gap) to 4 from step 12
    recs = [step(s, 0.1 * s, 2) for s in range(10)]
    recs += [step(10, 1.2, 3, gen=2), step(11, 1.3, 3, gen=2)]
    recs += [step(12 + s, 1.7 + 0.1 * s, 4, gen=3) for s in range(5)]
    # at an epoch's end a step on 2 members can have one worker's samples only
    recs[5] = step(5, 0.5, 1)
    # a halt and resume later: the restarted job numbers its generations from 1 again
    recs += [step(30 + s, 20 + 0.1 * s, 2, gen=1) for s in range(5)]
    assert bench.around_change(recs, 7, 4) == (9, 12, 2)
    seconds, iterations, reforms = bench.stall_of_change(recs, 7, 4)
    # 0.9 -> 1.7 is 0.8 s for 3 steps of 0.1 s: 0.5 s lost
    assert (seconds, iterations, reforms) == (pytest.approx(0.5), pytest.approx(5.0), 2)
    assert bench.stall(bench.step_times(recs), 9, 12) == (pytest.approx(0.5), pytest.approx(5.0))


def test_join_delays_say_when_the_extras_first_trained_in_each_window(bench: ModuleType) -> None:
    recs = [step(s, 100 + 0.5 * s, 4 if 6 <= s < 10 else 2) for s in range(40)]
    # windows open at 2 s and 12 s after t0=100: on 4 from step 6 (103.0), never in the second
    assert bench.join_delays(recs, 100.0, [(2.0, 5.0), (12.0, 15.0)]) == [
        pytest.approx(1.0),
        None,
    ]
