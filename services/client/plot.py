"""Draw metric curves to a PNG (matplotlib, headless)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from rhizome.v1 import tds_pb2


def plot_samples(samples: Iterable[tds_pb2.MetricSample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for s in samples:
        series[f"{s.name} (learner {s.learner})"].append((s.step, s.value))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("value")
    if series:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no metrics yet", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
