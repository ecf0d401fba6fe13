"""Spot-cluster traces: `<ms since start>,<add|remove>,<node>` a line, no header.

Shared by the simulator and the preemption injector. A bare file name such as
`aws-p3-64.csv` is looked up in the shared traces directory (`../shared/data/traces/`
next to the repository, or `RHIZOME_TRACES_DIR`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


class TraceError(ValueError):
    """A trace file is missing or malformed."""


@dataclass(frozen=True)
class TraceEvent:
    t_s: float
    kind: str  # "add" or "remove"
    node: str


@dataclass(frozen=True)
class Trace:
    name: str
    events: tuple[TraceEvent, ...]

    @property
    def duration_s(self) -> float:
        return self.events[-1].t_s if self.events else 0.0

    def removals(self) -> list[TraceEvent]:
        return [e for e in self.events if e.kind == "remove"]

    def removals_with_cluster_size(self) -> list[tuple[float, int]]:
        """(time, nodes alive just before) for each removal, replaying adds and removes."""
        alive = 0
        out = []
        for e in self.events:
            if e.kind == "add":
                alive += 1
            else:
                out.append((e.t_s, max(alive, 1)))
                alive = max(alive - 1, 0)
        return out

    @property
    def peak_size(self) -> int:
        alive = peak = 0
        for e in self.events:
            alive += 1 if e.kind == "add" else -1
            peak = max(peak, alive)
        return peak


def traces_dir() -> Path:
    env = os.environ.get("RHIZOME_TRACES_DIR")
    return Path(env) if env else REPO_ROOT.parent / "shared" / "data" / "traces"


def resolve(path: str | Path) -> Path:
    p = Path(path)
    if p.exists():
        return p
    candidate = traces_dir() / p
    if not p.is_absolute() and candidate.exists():
        return candidate
    raise TraceError(
        f"trace {path} not found (also looked in {traces_dir()}); pass a file path or set "
        "RHIZOME_TRACES_DIR"
    )


def load(path: str | Path) -> Trace:
    p = resolve(path)
    events = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.strip().split(",")
        if len(parts) != 3 or parts[1] not in ("add", "remove"):
            raise TraceError(
                f"{p}:{lineno}: expected '<ms>,<add|remove>,<node>', got {line.strip()!r}"
            )
        try:
            ms = float(parts[0])
        except ValueError:
            raise TraceError(f"{p}:{lineno}: time {parts[0]!r} is not a number of ms") from None
        events.append(TraceEvent(ms / 1000.0, parts[1], parts[2]))
    if not any(e.kind == "remove" for e in events):
        raise TraceError(f"{p}: no 'remove' (preemption) events")
    events.sort(key=lambda e: e.t_s)
    return Trace(p.name, tuple(events))
