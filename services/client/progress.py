"""`rhizome train --wait`'s progress line, from the metrics the job reports: its step, its
loss and, when it reports how many steps it will take (a metric named `total_steps`), the
time left at the pace of the steps so far."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rhizome.v1 import tds_pb2

TOTAL_STEPS = "total_steps"  # the metric a job reports for an ETA (docs/logs-and-metrics.md)


@dataclass
class Progress:
    step: int
    loss: float | None
    total: int | None
    eta_s: float | None

    def line(self) -> str:
        parts = [f"step {self.step}" + (f"/{self.total}" if self.total else "")]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4g}")
        if self.eta_s is not None:
            parts.append(f"ETA {format_eta(self.eta_s)}")
        return ", ".join(parts)


def format_eta(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def progress_of(samples: Iterable[tds_pb2.MetricSample]) -> Progress | None:
    """The job's progress from its samples (learner 0's, the lowest rank that reported),
    None before it reported a step."""
    by_learner: dict[int, list[tds_pb2.MetricSample]] = {}
    for s in samples:
        by_learner.setdefault(s.learner, []).append(s)
    if not by_learner:
        return None
    first: dict[int, float] = {}  # step -> time of its first sample
    loss: tuple[int, float] | None = None
    total: int | None = None
    for s in by_learner[min(by_learner)]:
        if s.name == TOTAL_STEPS:
            total = int(s.value)
            continue
        first.setdefault(s.step, s.time.seconds + s.time.nanos / 1e9)
        if "loss" in s.name.lower() and (loss is None or s.step >= loss[0]):
            loss = (s.step, s.value)
    if not first:
        return None
    steps = sorted(first)
    step = steps[-1]
    eta = None
    if total and step > steps[0]:
        per_step = (first[step] - first[steps[0]]) / (step - steps[0])
        eta = max(0, total - step) * per_step
    return Progress(step, loss[1] if loss else None, total, eta)
