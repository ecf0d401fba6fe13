"""What the platform may read of a learner's local checkpoints: when the newest one was
committed, and at which step.

The checkpoint SDK (learner/checkpoint/storage.py, `LocalDirectoryStore`) commits each
checkpoint as a directory `ckpt-<seq>-<kind>-s<step>` whose `COMMITTED` marker, written
last, holds the commit time (seconds since the epoch). The guardian reads the newest
marker under a job's checkpoint directory to tell the scheduler how much work a
preemption would lose (docs/elastic.md, "Preemption that loses the least work");
`tests/contract/test_checkpoints.py` checks this reading against the SDK's own commits.
Checkpoints kept only in S3 (`RHIZOME_BACKUP_URL`) are not seen here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

COMMITTED_MARKER = "COMMITTED"
_NAME = re.compile(r"^ckpt-\d{8}-[a-z]+-s(?P<step>\d+)$")
# <checkpoint dir>/<job>/<learner>/ckpt-*: at most this deep below the directory given
_MAX_DEPTH = 3


@dataclass(frozen=True)
class Commit:
    committed_at: float
    step: int


def newest_commit(root: str | Path) -> Commit | None:
    """The newest committed checkpoint under ``root`` (any learner), or None."""
    best: Commit | None = None
    base = Path(root)
    pattern = f"ckpt-*/{COMMITTED_MARKER}"
    for depth in range(_MAX_DEPTH + 1):
        for marker in base.glob("*/" * depth + pattern):
            m = _NAME.match(marker.parent.name)
            if m is None:
                continue
            try:
                at = float(marker.read_text().strip())
            except (OSError, ValueError):
                continue  # being written, or removed by garbage collection meanwhile
            if best is None or at > best.committed_at:
                best = Commit(at, int(m["step"]))
    return best
