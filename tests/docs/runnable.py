"""The runnable commands of the documentation, and how their shown output is matched.

The convention (docs/executable-docs.md): an HTML comment `<!-- runnable -->` on the line
before a fenced ```sh, ```bash or ```console block marks every command in it as one that
works here, against the embedded platform. In a ```console block a command starts with
`$ ` and the lines after it, up to the next command, are output it must show (in that
order, not necessarily every line of it); in a ```sh or ```bash block every line is a
command. Placeholders: `JOB_ID` is the job the document's last `rhizome train` created,
`TOKEN_ID` the token its last `rhizome token create` made; `...` in shown output matches
anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

MARKER = "<!-- runnable -->"
FENCES = ("```sh", "```bash", "```console")
PLACEHOLDERS = {"JOB_ID": r"\S+", "TOKEN_ID": r"tok_\S+"}


@dataclass
class Command:
    source: str  # file:line, for the failure message
    line: str
    shown: list[str] = field(default_factory=list)  # output the doc shows, in order


def runnable_commands(path: Path, root: Path) -> list[Command]:
    """Every command of `path`'s runnable blocks, in document order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    rel = path.relative_to(root)
    commands: list[Command] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != MARKER:
            i += 1
            continue
        fence = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if fence not in FENCES:
            raise ValueError(
                f"{rel}:{i + 1}: {MARKER} must be followed by a {', '.join(FENCES)} block, "
                f"not {fence!r}"
            )
        console = fence == "```console"
        j = i + 2
        while j < len(lines) and lines[j].strip() != "```":
            text = lines[j]
            where = f"{rel}:{j + 1}"
            if console:
                if text.startswith("$ "):
                    commands.append(Command(where, text[2:].strip()))
                elif text.strip() and commands:
                    commands[-1].shown.append(text)
            elif text.strip() and not text.lstrip().startswith("#"):
                commands.append(Command(where, text.strip()))
            j += 1
        if j == len(lines):
            raise ValueError(f"{rel}:{i + 1}: the runnable block is never closed")
        i = j + 1
    return commands


def shown_pattern(line: str) -> re.Pattern[str]:
    """A shown output line as a pattern: `...` is anything, JOB_ID/TOKEN_ID an id, runs
    of spaces any whitespace (tables are drawn to the terminal's width)."""
    parts = re.split(r"(\.\.\.|JOB_ID|TOKEN_ID|\s+)", line.strip())
    regex = ""
    for part in parts:
        if part == "...":
            regex += ".*"
        elif part in PLACEHOLDERS:
            regex += PLACEHOLDERS[part]
        elif part and part.isspace():
            regex += r"\s+"
        else:
            regex += re.escape(part)
    return re.compile(regex)


def missing_output(shown: list[str], actual: str) -> str | None:
    """The first shown line that `actual` lacks (shown lines must appear in order), or
    None when it shows them all."""
    actual_lines = actual.splitlines()
    k = 0
    for line in shown:
        pattern = shown_pattern(line)
        while k < len(actual_lines) and not pattern.search(actual_lines[k]):
            k += 1
        if k == len(actual_lines):
            return line
        k += 1
    return None
