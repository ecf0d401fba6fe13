"""`rhizome metrics JOB --plot F` (services/client/plot.py): a panel per metric, a line
per learner."""

from __future__ import annotations

from pathlib import Path

from rhizome.v1 import tds_pb2

from services.client.plot import panels, plot_samples

PNG = b"\x89PNG\r\n\x1a\n"


def sample(name: str, learner: int, step: int, value: float) -> tds_pb2.MetricSample:
    return tds_pb2.MetricSample(name=name, learner=learner, step=step, value=value)


def test_each_metric_gets_its_own_panel_with_a_line_per_learner_in_step_order() -> None:
    drawn = panels(
        [
            sample("runtime/iter_ms", 1, 1, 110.0),
            sample("runtime/loss", 1, 0, 3.9),
            sample("runtime/iter_ms", 0, 1, 100.0),
            sample("runtime/iter_ms", 0, 0, 90.0),
        ]
    )
    assert list(drawn) == ["runtime/iter_ms", "runtime/loss"]
    assert drawn["runtime/iter_ms"] == {0: [(0, 90.0), (1, 100.0)], 1: [(1, 110.0)]}
    assert drawn["runtime/loss"] == {1: [(0, 3.9)]}


def test_a_png_is_written_for_many_metrics_and_for_none(tmp_path: Path) -> None:
    many = [sample(f"m{k}", r, s, float(s)) for k in range(7) for r in (0, 1) for s in range(3)]
    plot_samples(many, tmp_path / "many.png")
    plot_samples([], tmp_path / "none.png")
    for name in ("many.png", "none.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG)
