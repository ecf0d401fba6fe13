"""Rendering for the CLI: prefixed lines, the latest-values table, the metrics plot."""

from __future__ import annotations

from pathlib import Path

import pytest
from rhizome.v1 import tds_pb2

from services.tds.render import format_log_line, format_table, latest_values, plot_metrics
from tests.services.tds.helpers import log_line


def _sample(learner: int, name: str, step: int, value: float) -> tds_pb2.MetricSample:
    m = tds_pb2.MetricSample(job_id="j", learner=learner, name=name, step=step, value=value)
    m.time.FromMicroseconds(1_700_000_000_000_000 + step)
    return m


def test_log_lines_get_learner_prefixes_naming_non_stdout_streams() -> None:
    assert format_log_line(log_line("j", 2, "stdout", 0, "hi", 0)) == "[learner 2] hi"
    assert format_log_line(log_line("j", 0, "stderr", 0, "oops", 0)) == "[learner 0 stderr] oops"
    assert format_log_line(log_line("j", 0, "stdout", 0, "x", 0), prefix=False) == "x"
    stamped = format_log_line(log_line("j", 0, "stdout", 0, "x", 1_500_000), timestamps=True)
    assert stamped == "1970-01-01T00:00:01.500000Z [learner 0] x"


def test_latest_values_take_the_highest_step_per_metric_and_learner() -> None:
    rows = latest_values(
        [_sample(0, "loss", 1, 0.9), _sample(0, "loss", 5, 0.2), _sample(1, "loss", 3, 0.4)]
    )
    assert [(r.name, r.learner, r.step, r.value) for r in rows] == [
        ("loss", 0, 5, 0.2),
        ("loss", 1, 3, 0.4),
    ]
    table = format_table(rows).splitlines()
    assert table[0].split() == ["metric", "learner", "step", "value"]
    assert table[1].split() == ["loss", "0", "5", "0.2"]


def test_plot_metrics_writes_a_png(tmp_path: Path) -> None:
    samples = [
        _sample(rank, n, s, 1 / (s + 1))
        for rank in (0, 1)
        for n in ("loss", "acc")
        for s in range(5)
    ]
    out = plot_metrics(samples, tmp_path / "m.png", title="job j")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_metrics_explains_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no metric samples"):
        plot_metrics([], tmp_path / "m.png")
    with pytest.raises(ValueError, match=r"ending in \.png"):
        plot_metrics([_sample(0, "loss", 1, 1.0)], tmp_path / "m.jpg")
