"""The worker's per-step metrics file (contract/runtime_metrics.py): one line per window
of ``every`` ended steps (the manifest's ``pipeline.metrics_every``, default 1).

On the platform the learner's collector ships the file (the job's metric source), so a
step's time, loss and where its redundant forward ran reach ``rhizome metrics``, the REST
gateway and the dashboard. Off the platform (no ``RHIZOME_RUNTIME_METRICS_FILE``) nothing
is written.

A line per step is 7 metric documents per stage per step in the search server; a fast
model's hundreds of steps a second would crowd out every other job's logs there. With
``every`` > 1 a line stands for the ``every`` steps that end at its step: times and the
loss are their means, the generation the last step's. Nothing is sampled away (a slow
step raises its window's mean), and the last, partial window is written when the worker
stops.

Writing the metrics must never stop training: a file that cannot be opened or written
(a full disk, a directory removed under the job) is reported once on the worker's log
and the metrics stop; the step goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import IO

from contract import runtime_metrics


class StepMetricsFile:
    """Appends ``runtime_metrics.line`` every ``every`` steps to ``path``; a no-op when
    ``path`` is None."""

    def __init__(self, path: str | None, log: Callable[[str], None], every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"every={every}: a window is at least one step")
        self.path = path
        self.every = every
        self._log = log
        self._file: IO[str] | None = None
        self._broken = path is None
        # the open window: its last step, how many steps, the sums, the last generation
        self._step = -1
        self._steps = 0
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._generation = 0

    def write(
        self,
        step: int,
        *,
        iter_s: float,
        generation: int,
        loss: float | None,
        frc_s: Mapping[str, float] | None,
    ) -> None:
        """One ended step. ``frc_s``: seconds of eager FRC per place (bubbles.PLACES),
        None where the mode runs no eager FRC. Its window's line is written once the
        window holds ``every`` steps."""
        if self._broken:
            return
        self._add(runtime_metrics.ITER_MS, iter_s * 1000.0)
        if loss is not None:
            self._add(runtime_metrics.LOSS, loss)
        for place, seconds in (frc_s or {}).items():
            self._add(runtime_metrics.FRC_MS[place], seconds * 1000.0)
        self._step, self._generation = step, generation
        self._steps += 1
        if self._steps >= self.every:
            self._flush()

    def _add(self, name: str, value: float) -> None:
        self._sums[name] = self._sums.get(name, 0.0) + value
        self._counts[name] = self._counts.get(name, 0) + 1

    def _flush(self) -> None:
        if self._steps == 0 or self._broken:
            return
        values = {
            name: total / self._counts[name]
            if name == runtime_metrics.LOSS
            # times in ms, rounded to the microsecond
            else round(total / self._counts[name], 3)
            for name, total in self._sums.items()
        }
        values[runtime_metrics.GENERATION] = float(self._generation)
        self._steps, self._sums, self._counts = 0, {}, {}
        try:
            if self._file is None:
                assert self.path is not None
                # line-buffered: each window's line reaches the collector when it ends
                self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
            self._file.write(runtime_metrics.line(self._step, time.time(), values))
        except OSError as exc:
            self._broken = True
            self._log(f"per-step metrics stopped: cannot write {self.path}: {exc}")

    def close(self) -> None:
        """Write the last, partial window, and close the file."""
        self._flush()
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
