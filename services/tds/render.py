"""What the CLI and the REST gateway show: prefixed log lines, a table of the latest
metric values, and metric curves drawn to a PNG."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rhizome.v1 import tds_pb2

from services.tds.api import time_us


def learner_prefix(learner: int, stream: str) -> str:
    """`[learner 0]` for stdout; the stream is named when it is not stdout."""
    return f"[learner {learner}]" if stream == "stdout" else f"[learner {learner} {stream}]"


def format_log_line(line: tds_pb2.LogLine, *, prefix: bool = True, timestamps: bool = False) -> str:
    parts = []
    if timestamps:
        when = dt.datetime.fromtimestamp(time_us(line) / 1e6, tz=dt.UTC)
        parts.append(when.strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
    if prefix:
        parts.append(learner_prefix(line.learner, line.stream))
    parts.append(line.line)
    return " ".join(parts)


def format_log_lines(
    lines: Iterable[tds_pb2.LogLine], *, prefix: bool = True, timestamps: bool = False
) -> Iterable[str]:
    for line in lines:
        yield format_log_line(line, prefix=prefix, timestamps=timestamps)


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


def format_table(rows: Sequence[Latest]) -> str:
    """A plain-text table (the CLI may draw it with rich instead; same columns)."""
    header = ("metric", "learner", "step", "value")
    body = [(r.name, str(r.learner), str(r.step), f"{r.value:.6g}") for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=False)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in body]
    return "\n".join(lines)


def plot_metrics(
    samples: Iterable[tds_pb2.MetricSample], path: str | Path, *, title: str | None = None
) -> Path:
    """Draw one panel per metric, one curve per learner, against the step (or the time
    when a metric has no steps), and save it as a PNG at `path`."""
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
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 2.8 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        for learner, pts in sorted(series[name].items()):
            has_steps = any(p[0] != 0 for p in pts)
            pts.sort(key=lambda p: (p[0], p[1]) if has_steps else (p[1], p[0]))
            xs = [p[0] if has_steps else p[1] for p in pts]
            ys = [p[2] for p in pts]
            ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=f"learner {learner}")
            ax.set_xlabel("step" if has_steps else "time (s since epoch)")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out
