"""The worker's per-step metrics file (contract/runtime_metrics.py): one line per ended step.

On the platform the learner's collector ships the file (the job's metric source), so a
step's time, loss and where its redundant forward ran reach ``rhizome metrics``, the REST
gateway and the dashboard. Off the platform (no ``RHIZOME_RUNTIME_METRICS_FILE``) nothing
is written.

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
    """Appends ``runtime_metrics.line`` per step to ``path``; a no-op when ``path`` is None."""

    def __init__(self, path: str | None, log: Callable[[str], None]) -> None:
        self.path = path
        self._log = log
        self._file: IO[str] | None = None
        self._broken = path is None

    def write(
        self,
        step: int,
        *,
        iter_s: float,
        generation: int,
        loss: float | None,
        frc_s: Mapping[str, float] | None,
    ) -> None:
        """One step's line. ``frc_s``: seconds of eager FRC per place (bubbles.PLACES),
        None where the mode runs no eager FRC."""
        if self._broken:
            return
        values = {
            runtime_metrics.ITER_MS: round(iter_s * 1000.0, 3),
            runtime_metrics.GENERATION: float(generation),
        }
        if loss is not None:
            values[runtime_metrics.LOSS] = loss
        for place, seconds in (frc_s or {}).items():
            values[runtime_metrics.FRC_MS[place]] = round(seconds * 1000.0, 3)
        try:
            if self._file is None:
                assert self.path is not None
                # line-buffered: each step's line reaches the collector when the step ends
                self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
            self._file.write(runtime_metrics.line(step, time.time(), values))
        except OSError as exc:
            self._broken = True
            self._log(f"per-step metrics stopped: cannot write {self.path}: {exc}")

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
