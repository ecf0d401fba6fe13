"""How a learner reports a committed checkpoint to the platform: one line on its stderr.

Why a log line: every backend already ships the command's stderr to the training data
service (the collector, or the container log helper), from any learner, with no etcd or
API access in the user's process, and re-sends after a crash are idempotent there. The
TDS recognises the line (`parse`) and keeps it on the job's record (`checkpoints`, a
bounded list: services/tds/checkpoints.py), where `rhizome show`, the REST/gRPC `Job` and
the dashboard's job page read it.

The line is `MARK` followed by a JSON object:
`{"kind": "insurance", "step": 900, "size_bytes": 12345, "time": 1700000000.5,
"learner": "0", "name": "ckpt-..."}`. A line that starts with MARK but does not parse is
ignored by the platform (and logged there): it is the user's own output.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

MARK = "rhizome:checkpoint "
# The kinds learner/checkpoint/api.py's CheckpointKind names (the contract has no torch).
KINDS = ("periodic", "insurance", "emergency")
# How many checkpoints a job's record keeps (the newest): enough for the page's table.
MAX_KEPT = 50


@dataclass(frozen=True)
class CheckpointReport:
    kind: str
    step: int
    size_bytes: int
    time: float
    learner: str = "0"
    name: str = ""

    def line(self) -> str:
        return MARK + json.dumps(asdict(self), sort_keys=True)

    def key(self) -> tuple[str, str, int, float]:
        """What identifies one save (a line shipped twice is one checkpoint)."""
        return (self.learner, self.name, self.step, self.time)


def parse(line: str) -> CheckpointReport | None:
    """The report a line carries, or None when it is not one (or is malformed)."""
    # Only at the start of a line: text that quotes the mark is not a report.
    if not line.startswith(MARK):
        return None
    try:
        doc: Any = json.loads(line[len(MARK) :])
        report = CheckpointReport(
            kind=str(doc["kind"]),
            step=int(doc["step"]),
            size_bytes=int(doc["size_bytes"]),
            time=float(doc["time"]),
            learner=str(doc.get("learner", "0"))[:64],
            name=str(doc.get("name", ""))[:200],
        )
    except (ValueError, KeyError, TypeError):
        return None
    if report.kind not in KINDS or report.step < 0 or report.size_bytes < 0:
        return None
    return report
