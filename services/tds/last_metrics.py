"""The newest sample of each metric per job, written onto the job's record at a bounded rate.

Why here: the TDS is the one place every metric sample passes through (the learners'
collectors send them with AddMetrics), and the jobs list must show a job's last metric
without querying the search server per row (50 rows every 3 s would miss the page's
300 ms goal). So the TDS remembers, per job and metric name, the newest sample it
accepted, and a flusher writes what changed onto the job record (`last_metrics`,
`JobsRepository.set_last_metrics`) at most once per `interval_s` per job: however fast a
job logs, its record takes one small write per interval, and a quiet job none.

What it costs: memory for the jobs that emitted since the last flush only (the state of
a flushed job is dropped; the store merges with what it holds). A TDS that dies loses at
most one interval of last values; the next sample of each metric puts them back. Two TDS
replicas flushing the same job at the same moment may each merge over the other's read
(`set_last_metrics` reads, merges, writes): one name's value can then lag by one
interval, until that metric's next sample.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from rhizome.v1 import tds_pb2

from services.tds.api import time_us

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 5.0
MAX_NAME = 128  # a metric name is the user's regex group: bound what the record holds

# job_id, [{name, value, step, time, learner}] -> whether the job is stored
Write = Callable[[str, list[dict[str, Any]]], bool]


def sample_row(s: tds_pb2.MetricSample) -> dict[str, Any]:
    return {
        "name": s.name[:MAX_NAME],
        "value": float(s.value),
        "step": int(s.step),
        "time": time_us(s) / 1e6,
        "learner": int(s.learner),
    }


class LastMetrics:
    def __init__(self, write: Write, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self._write = write
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, dict[str, Any]]] = {}  # job -> name -> row
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def observe(self, samples: Iterable[tds_pb2.MetricSample]) -> None:
        """Note accepted samples (called by AddMetrics after the store took them)."""
        with self._lock:
            for s in samples:
                rows = self._pending.setdefault(s.job_id, {})
                row = sample_row(s)
                held = rows.get(row["name"])
                if held is None or row["time"] >= held["time"]:
                    rows[row["name"]] = row

    def flush(self) -> int:
        """Write every job's pending last values; returns how many jobs were written. A job
        whose write fails keeps its values for the next flush, unless newer ones came."""
        with self._lock:
            pending, self._pending = self._pending, {}
        written = 0
        for job_id, rows in pending.items():
            try:
                self._write(job_id, list(rows.values()))
                written += 1
            except Exception as exc:  # the jobs store is down: keep them for the next try
                log.warning("could not record the last metrics of %s, will retry: %s", job_id, exc)
                with self._lock:
                    newer = self._pending.setdefault(job_id, {})
                    for name, row in rows.items():
                        newer.setdefault(name, row)
        return written

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tds-last-metrics", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.flush()

    def close(self) -> None:
        """Stop the flusher and write what is pending (a clean shutdown loses nothing)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()
