"""What `rhizome metrics` shows of a job's metric samples: the latest value of each
metric per learner, and the curves drawn to a PNG (`--plot`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from rhizome.v1 import tds_pb2

from services.tds.api import time_us

# panels per row before the figure wraps
PLOT_COLUMNS = 3


@dataclass(frozen=True)
class Latest:
    name: str
    learner: int
    step: int
    value: float
    time_us: int


def latest_values(samples: Iterable[tds_pb2.MetricSample]) -> list[Latest]:
    """The latest sample of every (metric, learner): highest step, then newest time."""
    best: dict[tuple[str, int], Latest] = {}
    for s in samples:
        cand = Latest(s.name, s.learner, s.step, s.value, time_us(s))
        cur = best.get((s.name, s.learner))
        if cur is None or (cand.step, cand.time_us) >= (cur.step, cur.time_us):
            best[(s.name, s.learner)] = cand
    return sorted(best.values(), key=lambda x: (x.name, x.learner))


def plot_metrics(
    samples: Iterable[tds_pb2.MetricSample], path: str | Path, *, title: str | None = None
) -> Path:
    """Draw one panel per metric (up to PLOT_COLUMNS a row), one curve per learner in the
    same colour on every panel, against the step (or the time when a metric has no
    steps), and save it as a PNG at `path`.

    Panels, not one axis: a pipeline job's dozen `runtime/*` series would share one scale
    (a 100 ms step time flattens a loss of 2) and matplotlib's ten colours."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt

    series: dict[str, dict[int, list[tuple[float, float, float]]]] = {}
    for s in samples:
        series.setdefault(s.name, {}).setdefault(s.learner, []).append(
            (float(s.step), time_us(s) / 1e6, s.value)
        )
    if not series:
        raise ValueError(
            "no metric samples to plot: the job has not reported any yet "
            "(check its evaluation_metrics in the manifest)"
        )
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise ValueError(f"{out}: the plot is written as PNG; give a file name ending in .png")
    names = sorted(series)
    columns = min(PLOT_COLUMNS, len(names))
    rows = math.ceil(len(names) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 2.8 * rows), squeeze=False)
    learners = sorted({learner for by_learner in series.values() for learner in by_learner})
    colour = {learner: f"C{i % 10}" for i, learner in enumerate(learners)}
    flat = [ax for row in axes for ax in row]
    for i, (ax, name) in enumerate(zip(flat, names, strict=False)):
        for learner, pts in sorted(series[name].items()):
            has_steps = any(p[0] != 0 for p in pts)
            pts.sort(key=lambda p: (p[0], p[1]) if has_steps else (p[1], p[0]))
            xs = [p[0] if has_steps else p[1] for p in pts]
            ys = [p[2] for p in pts]
            ax.plot(xs, ys, marker="." if len(xs) < 50 else None, color=colour[learner])
            if i + columns >= len(names):  # the lowest panel of its column
                ax.set_xlabel("step" if has_steps else "time (s since epoch)")
        ax.set_title(name, fontsize="medium")
        ax.grid(True, alpha=0.3)
    for ax in flat[len(names) :]:
        ax.set_visible(False)
    handles = [plt.Line2D([], [], color=colour[n], label=f"learner {n}") for n in learners]
    fig.legend(handles=handles, loc="upper right", fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.9 if columns > 1 else 0.8, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out
