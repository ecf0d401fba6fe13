"""Draw metric curves to a PNG (matplotlib, headless): one panel per metric, a line per
learner in the same colour on every panel.

All on one axis, a pipeline job's dozen `runtime/*` series (each stage's step time, FRC
split, generation, loss) shared one scale and matplotlib's ten colours, so a 100 ms step
time flattened a 0.5 loss and two series of different metrics had the same colour."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from rhizome.v1 import tds_pb2

# panels per row before the figure wraps
COLUMNS = 3

Panels = dict[str, dict[int, list[tuple[int, float]]]]


def panels(samples: Iterable[tds_pb2.MetricSample]) -> Panels:
    """metric name -> learner -> (step, value) points in step order."""
    out: Panels = defaultdict(lambda: defaultdict(list))
    for s in samples:
        out[s.name][s.learner].append((s.step, s.value))
    for by_learner in out.values():
        for points in by_learner.values():
            points.sort()
    return {name: dict(out[name]) for name in sorted(out)}


def plot_samples(samples: Iterable[tds_pb2.MetricSample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = panels(samples)
    columns = max(1, min(COLUMNS, len(drawn)))
    rows = max(1, math.ceil(len(drawn) / columns))
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 2.8 * rows), squeeze=False)
    learners = sorted({rank for by_learner in drawn.values() for rank in by_learner})
    colour = {rank: f"C{i % 10}" for i, rank in enumerate(learners)}
    flat = [ax for row in axes for ax in row]
    for i, (ax, (name, by_learner)) in enumerate(zip(flat, drawn.items(), strict=False)):
        for rank, points in sorted(by_learner.items()):
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                color=colour[rank],
                label=f"learner {rank}",
            )
        ax.set_title(name, fontsize="medium")
        ax.grid(alpha=0.3)
        if i + columns >= len(drawn):  # the lowest panel of its column
            ax.set_xlabel("step")
    for ax in flat[len(drawn) :]:
        ax.set_visible(False)
    if drawn:
        handles = [
            plt.Line2D([], [], color=colour[rank], label=f"learner {rank}") for rank in learners
        ]
        fig.legend(handles=handles, loc="upper right", fontsize="small")
    else:
        flat[0].text(
            0.5, 0.5, "no metrics yet", ha="center", va="center", transform=flat[0].transAxes
        )
    fig.tight_layout(rect=(0, 0, 0.92 if drawn else 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
