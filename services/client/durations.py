"""Durations as people type them on the command line: `90`, `90s`, `15m`, `2h`, `30d`, `2w`."""

from __future__ import annotations

import re

import click

_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """Seconds; a bad value is a click.BadParameter saying how to write one."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhdw]?)\s*", str(text))
    if not m:
        raise click.BadParameter(f"{text!r} is not a duration; write e.g. 90s, 15m, 2h or 30d")
    return float(m[1]) * _UNITS[m[2]]
