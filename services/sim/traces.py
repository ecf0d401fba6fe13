"""Spot-cluster preemption traces, in the two public formats, checked row by row.

Shared by the simulator and the preemption injector. Two formats are read, recognised
by their first data row (a header row naming the columns is skipped):

- events (Bamboo's AWS traces): `<ms since start>,<add|remove>,<node>` a line;
  `remove` is a preemption, `add` an instance joining.
- counts (the public GCP preemption traces): `<date>,<time>,<active node count>` a line,
  e.g. `2022-03-01,14:05:09,64`. Each change of the count becomes that many adds or
  removes at that time (removes take the longest-lived nodes first; only the times
  matter to the simulator and the injector). Repeated timestamps are allowed: the count
  may change several times within one second of the trace's resolution.

Rows must not go back in time and must not repeat (the same event row twice, or the same
timestamp with the same count twice): either means the trace was concatenated or
edited by mistake, and the simulator would otherwise model preemptions that never
happened. Every error names the file, the line and what to write instead.

A bare file name such as `aws-p3-64.csv` is looked up in `RHIZOME_TRACES_DIR` when it is
set, then among the traces shipped with the package (`services/sim/data/traces/`, see
its README).
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

BUNDLED_TRACES = Path(__file__).resolve().parent / "data" / "traces"

EVENTS_FORMAT = "'<ms>,<add|remove>,<node>' (AWS-style events)"
COUNTS_FORMAT = (
    "'<date>,<time>,<active node count>' (GCP-style counts, e.g. 2022-03-01,14:05:09,64)"
)
_DATE_FORMATS = ("%Y-%m-%d", "%m/%d/%Y", "%Y/%m/%d")
_TIME_FORMATS = ("%H:%M:%S", "%H:%M:%S.%f", "%H:%M")


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
    format: str = "events"  # "events" or "counts"

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
    if p.is_file():
        return p
    if p.exists():
        raise TraceError(f"trace {path} is not a file; pass a CSV trace file")
    if not p.is_absolute():
        for d in traces_dirs():
            if (d / p).is_file():
                return d / p
    where = ", ".join(str(d) for d in traces_dirs())
    raise TraceError(
        f"trace {path} not found (also looked in {where}); pass a file path, one of the "
        f"bundled traces ({', '.join(bundled())}), or set RHIZOME_TRACES_DIR"
    )


def _fields(line: str) -> list[str]:
    return [f.strip() for f in line.strip().split(",")]


def _is_header(fields: list[str]) -> bool:
    """A header row names its columns (`date,time,count`, `ms,event,node`): no field is a
    number and some field is a column word. Anything else is a data row, checked as one."""
    words = ("time", "date", "count", "event", "node", "kind", "ms")
    numeric = any(f.replace(".", "", 1).isdigit() for f in fields)
    return (
        not numeric
        and any(w in f.lower() for f in fields for w in words)
        and not (len(fields) == 3 and fields[1] in ("add", "remove"))
    )


def _timestamp(date: str, time: str) -> datetime | None:
    for dfmt in _DATE_FORMATS:
        for tfmt in _TIME_FORMATS:
            try:
                return datetime.strptime(f"{date} {time}", f"{dfmt} {tfmt}")
            except ValueError:
                continue
    return None


def _format_of(p: Path, lineno: int, fields: list[str]) -> str:
    if len(fields) == 3 and fields[1] in ("add", "remove"):
        return "events"
    if len(fields) == 3 and _timestamp(fields[0], fields[1]) is not None:
        return "counts"
    raise TraceError(
        f"{p}:{lineno}: unknown trace format, got {','.join(fields)!r}; write "
        f"{EVENTS_FORMAT} or {COUNTS_FORMAT} rows"
    )


def _events(p: Path, rows: list[tuple[int, list[str]]]) -> list[TraceEvent]:
    events: list[TraceEvent] = []
    seen: dict[tuple[float, str, str], int] = {}
    previous = ""
    for lineno, fields in rows:
        if len(fields) != 3 or fields[1] not in ("add", "remove") or not fields[2]:
            raise TraceError(
                f"{p}:{lineno}: expected {EVENTS_FORMAT} like the rows above, "
                f"got {','.join(fields)!r}"
            )
        try:
            ms = float(fields[0])
        except ValueError:
            raise TraceError(
                f"{p}:{lineno}: time {fields[0]!r} is not a number of milliseconds"
            ) from None
        if not ms >= 0 or ms == float("inf"):
            raise TraceError(f"{p}:{lineno}: time {fields[0]!r} must be a finite number >= 0 ms")
        # the number, not its text: 1000 and 1000.0 are the same time
        key = (ms, fields[1], fields[2])
        if key in seen:
            raise TraceError(
                f"{p}:{lineno}: duplicate row (same as line {seen[key]}): "
                f"{fields[0]} ms {fields[1]} {fields[2]} twice; remove one"
            )
        seen[key] = lineno
        if events and ms / 1000.0 < events[-1].t_s:
            raise TraceError(
                f"{p}:{lineno}: time goes backwards ({fields[0]} ms after "
                f"{previous} ms on an earlier line); sort the rows by time"
            )
        previous = fields[0]
        events.append(TraceEvent(ms / 1000.0, fields[1], fields[2]))
    return events


def _counts(p: Path, rows: list[tuple[int, list[str]]]) -> list[TraceEvent]:
    events: list[TraceEvent] = []
    alive: deque[str] = deque()
    made = 0
    start: datetime | None = None
    last: tuple[datetime, int, int] | None = None  # (time, count, line)
    for lineno, fields in rows:
        stamp = _timestamp(fields[0], fields[1]) if len(fields) == 3 else None
        if stamp is None:
            raise TraceError(
                f"{p}:{lineno}: expected {COUNTS_FORMAT} like the rows above, "
                f"got {','.join(fields)!r}"
            )
        try:
            count = int(fields[2])
        except ValueError:
            raise TraceError(
                f"{p}:{lineno}: node count {fields[2]!r} is not a whole number"
            ) from None
        if count < 0:
            raise TraceError(f"{p}:{lineno}: node count {count} must be >= 0")
        if last is not None:
            if stamp < last[0]:
                raise TraceError(
                    f"{p}:{lineno}: time goes backwards ({fields[0]} {fields[1]} is before "
                    f"line {last[2]}); sort the rows by time"
                )
            if stamp == last[0] and count == last[1]:
                raise TraceError(
                    f"{p}:{lineno}: duplicate row (same time and count as line {last[2]}); "
                    "remove one"
                )
        start = start or stamp
        t_s = (stamp - start).total_seconds()
        while len(alive) < count:
            made += 1
            alive.append(f"node{made}")
            events.append(TraceEvent(t_s, "add", alive[-1]))
        while len(alive) > count:
            events.append(TraceEvent(t_s, "remove", alive.popleft()))
        last = (stamp, count, lineno)
    return events


def load(path: str | Path) -> Trace:
    """Read a trace in either format; a `TraceError` names the line and the fix."""
    p = resolve(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise TraceError(f"cannot read trace {p}: {err}") from None
    rows = [(n, _fields(line)) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if rows and _is_header(rows[0][1]):
        rows = rows[1:]
    if not rows:
        raise TraceError(f"{p}: the trace is empty; write {EVENTS_FORMAT} or {COUNTS_FORMAT} rows")
    fmt = _format_of(p, *rows[0])
    events = _events(p, rows) if fmt == "events" else _counts(p, rows)
    if not any(e.kind == "remove" for e in events):
        raise TraceError(
            f"{p}: no preemptions (no 'remove' rows, or a node count that never falls)"
        )
    return Trace(p.name, tuple(events), fmt)
