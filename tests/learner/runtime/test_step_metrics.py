"""The worker's per-step metrics file (learner/runtime/step_metrics.py), read back by the
platform's own metric source (emetrics_file), as the learner's collector reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract import runtime_metrics
from learner.controller.metric_sources.emetrics_file import parse_line
from learner.runtime.api import RedundancyMode
from learner.runtime.bubbles import PLACES
from learner.runtime.engine import Worker, WorkerOptions
from learner.runtime.inprocess import run_workers
from learner.runtime.step_metrics import StepMetricsFile
from learner.runtime.toy import toy_job

STEPS = 4
FRC_NAMES = {f"runtime/{runtime_metrics.FRC_MS[p]}" for p in PLACES}


def _run(mode: RedundancyMode, files: list[Path | None], every: int = 1) -> list[Worker]:
    """Two in-process workers (in-memory cluster state, gloo over a HashStore)."""
    job = toy_job(steps=STEPS, microbatches=4, redundancy=mode)
    opts = [
        WorkerOptions(
            worker=w,
            stages=2,
            pipelines=1,
            verbose=False,
            metrics_file=None if files[w] is None else str(files[w]),
            metrics_every=every,
        )
        for w in range(2)
    ]
    return [worker for worker, _ in run_workers(job, opts)]


def _samples(path: Path) -> dict[int, dict[str, float]]:
    """step -> {metric name: value}, through the collector's emetrics_file parser."""
    out: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        for s in parse_line(json.loads(line)):
            out.setdefault(s.step, {})[s.name] = s.value
    return out


def test_each_ended_step_reports_its_time_generation_loss_and_where_its_frc_ran(
    tmp_path: Path,
) -> None:
    files: list[Path | None] = [tmp_path / "w0.jsonl", tmp_path / "w1.jsonl"]
    workers = _run(RedundancyMode.EAGER_FRC_LAZY_BRC, files)
    for w, worker in enumerate(workers):
        path = files[w]
        assert path is not None
        per_step = _samples(path)
        assert sorted(per_step) == list(range(STEPS))  # one line per step, in order
        for step, values in per_step.items():
            assert values["runtime/iter_ms"] > 0
            assert values["runtime/generation"] == 0
            # the last stage holds the loss; the first does not
            assert ("runtime/loss" in values) == (w == 1)
            assert set(values) >= FRC_NAMES
            # the metric is the profile's own record of the step, in ms
            row = worker.interpreter.frc_profile.per_step.get(step, dict.fromkeys(PLACES, 0.0))
            for place in PLACES:
                name = f"runtime/{runtime_metrics.FRC_MS[place]}"
                assert values[name] == pytest.approx(row[place] * 1000.0, abs=1e-3)
        assert dict(workers[1].loss_history)[STEPS - 1] == pytest.approx(
            _samples(files[1])[STEPS - 1]["runtime/loss"]  # type: ignore[arg-type]
        )
    # every step's FRC ran somewhere: the eager mode ran the replica's forward each step
    assert any(
        sum(v for k, v in values.items() if k in FRC_NAMES) > 0
        for p in files
        if p is not None
        for values in _samples(p).values()
    )


def test_a_mode_without_eager_frc_reports_no_frc_metrics(tmp_path: Path) -> None:
    files: list[Path | None] = [tmp_path / "w0.jsonl", None]
    _run(RedundancyMode.NONE, files)
    per_step = _samples(tmp_path / "w0.jsonl")
    assert sorted(per_step) == list(range(STEPS))
    assert not FRC_NAMES & {name for values in per_step.values() for name in values}


def test_an_unwritable_metrics_file_is_reported_once_and_training_goes_on(
    tmp_path: Path,
) -> None:
    said: list[str] = []
    metrics = StepMetricsFile(str(tmp_path / "missing-dir" / "m.jsonl"), said.append)
    for step in range(3):
        metrics.write(step, iter_s=0.1, generation=0, loss=None, frc_s=None)
    metrics.close()
    assert len(said) == 1 and "per-step metrics stopped: cannot write" in said[0], said
    assert not (tmp_path / "missing-dir").exists()


def test_no_path_writes_nothing(tmp_path: Path) -> None:
    said: list[str] = []
    metrics = StepMetricsFile(None, said.append)
    metrics.write(0, iter_s=0.1, generation=0, loss=1.0, frc_s={"bubble": 0.01})
    metrics.close()
    assert said == [] and list(tmp_path.iterdir()) == []


def test_with_metrics_every_a_line_stands_for_its_window_of_steps(tmp_path: Path) -> None:
    """`pipeline.metrics_every: 2` over 4 steps: lines at steps 1 and 3, each the mean of
    its two steps' times (as the worker measured them) and losses."""
    files: list[Path | None] = [tmp_path / "w0.jsonl", tmp_path / "w1.jsonl"]
    workers = _run(RedundancyMode.EAGER_FRC_LAZY_BRC, files, every=2)
    last = files[1]
    assert last is not None
    per_step = _samples(last)
    assert sorted(per_step) == [1, 3]
    times = dict(workers[1].step_times)
    losses = dict(workers[1].loss_history)
    for end in (1, 3):
        window = (end - 1, end)
        assert per_step[end]["runtime/iter_ms"] == pytest.approx(
            sum(times[s] for s in window) * 1000.0 / 2, abs=1e-3
        )
        assert per_step[end]["runtime/loss"] == pytest.approx(sum(losses[s] for s in window) / 2)
        assert set(per_step[end]) >= FRC_NAMES


def test_a_partial_window_is_written_when_the_worker_stops(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    metrics = StepMetricsFile(str(path), print, every=3)
    for step in range(5):  # a window of 0-2, then 3-4 left open
        metrics.write(
            step, iter_s=0.1 * (step + 1), generation=step // 4, loss=float(step), frc_s=None
        )
    assert sorted(_samples(path)) == [2]
    metrics.close()
    per_step = _samples(path)
    assert sorted(per_step) == [2, 4]
    assert per_step[2]["runtime/iter_ms"] == pytest.approx(200.0)  # (100 + 200 + 300) / 3
    assert per_step[4] == {
        "runtime/iter_ms": pytest.approx(450.0),
        "runtime/loss": pytest.approx(3.5),
        "runtime/generation": 1.0,  # the window's last step's
    }


def test_a_window_of_no_step_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one step"):
        StepMetricsFile(None, print, every=0)
