"""What `rhizome metrics` shows (services/tds/render.py): the latest values, the plot."""

from __future__ import annotations

from pathlib import Path

import pytest
from rhizome.v1 import tds_pb2

from services.tds.render import latest_values, plot_metrics


def _sample(learner: int, name: str, step: int, value: float) -> tds_pb2.MetricSample:
    m = tds_pb2.MetricSample(job_id="j", learner=learner, name=name, step=step, value=value)
    m.time.FromMicroseconds(1_700_000_000_000_000 + step)
    return m


def test_latest_values_take_the_highest_step_per_metric_and_learner() -> None:
    rows = latest_values(
        [_sample(0, "loss", 1, 0.9), _sample(0, "loss", 5, 0.2), _sample(1, "loss", 3, 0.4)]
    )
    assert [(r.name, r.learner, r.step, r.value) for r in rows] == [
        ("loss", 0, 5, 0.2),
        ("loss", 1, 3, 0.4),
    ]


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


def test_a_pipeline_job_s_many_metrics_are_drawn_a_panel_each(tmp_path: Path) -> None:
    """Thirteen series of seven metrics (two stages; the loss on the last only), as a
    pipeline job's runtime metrics are: a grid of panels, not one axis."""
    names = ["iter_ms", "generation", "frc_bubble_ms", "frc_sync_ms", "frc_overrun_ms"]
    samples = [
        _sample(rank, f"runtime/{n}", s, float(s)) for rank in (0, 1) for n in names for s in (1, 2)
    ] + [_sample(1, "runtime/loss", s, 3.0 - s) for s in (1, 2)]
    out = plot_metrics(samples, tmp_path / "m.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
