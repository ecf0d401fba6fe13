"""Checkpoint reports in a job's log lines onto the job's record.

A learner's checkpoint SDK prints one line per committed save on stderr
(contract/checkpoints.py); every backend ships it here with the job's other lines. The
TDS picks those lines out of each accepted batch (a prefix test per line, nothing more
for the rest) and merges them into the record's bounded `checkpoints` list
(`JobsRepository.add_checkpoints`, which drops a line shipped twice). Saves are rare
(minutes apart), so this is one small write per save, made after the lines are stored.
A failed write is logged and the report is lost for the record only (the line stays in
the logs, `rhizome logs --search rhizome:checkpoint`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from rhizome.v1 import tds_pb2

from contract.checkpoints import MARK, parse

log = logging.getLogger(__name__)

# job_id, [report as a dict] -> whether the job is stored
Write = Callable[[str, list[dict[str, Any]]], bool]


class CheckpointReports:
    def __init__(self, write: Write) -> None:
        self._write = write

    def observe(self, lines: Sequence[tds_pb2.LogLine]) -> int:
        """Record the reports among accepted lines; returns how many were found."""
        found: dict[str, list[dict[str, Any]]] = {}
        for ln in lines:
            if not ln.line.startswith(MARK):
                continue
            report = parse(ln.line)
            if report is None:
                log.info("job %s: a line starts with %r but is no report", ln.job_id, MARK)
                continue
            found.setdefault(ln.job_id, []).append(asdict(report))
        for job_id, reports in found.items():
            try:
                self._write(job_id, reports)
            except Exception as exc:  # the jobs store is down: the line stays in the logs
                log.warning(
                    "could not record %d checkpoint(s) of %s: %s", len(reports), job_id, exc
                )
        return sum(len(r) for r in found.values())
