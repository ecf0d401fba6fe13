"""Spot-cluster traces: `<ms since start>,<add|remove>,<node>` a line, no header.

Shared by the simulator and the preemption injector. A bare file name such as
`aws-p3-64.csv` is looked up in `RHIZOME_TRACES_DIR` when it is set, then among the
traces shipped with the package (`services/sim/data/traces/`, see its README).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

BUNDLED_TRACES = Path(__file__).resolve().parent / "data" / "traces"


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


def traces_dirs() -> list[Path]:
    """Where a bare trace name is looked up, in order."""
    env = os.environ.get("RHIZOME_TRACES_DIR")
    return [Path(env), BUNDLED_TRACES] if env else [BUNDLED_TRACES]


def bundled() -> list[str]:
    """Names of the traces shipped with the package."""
    return sorted(p.name for p in BUNDLED_TRACES.glob("*.csv"))


def resolve(path: str | Path) -> Path:
    p = Path(path)
    if p.exists():
        return p
    if not p.is_absolute():
        for d in traces_dirs():
            if (d / p).exists():
                return d / p
    where = ", ".join(str(d) for d in traces_dirs())
    raise TraceError(
        f"trace {path} not found (also looked in {where}); pass a file path, one of the "
        f"bundled traces ({', '.join(bundled())}), or set RHIZOME_TRACES_DIR"
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
