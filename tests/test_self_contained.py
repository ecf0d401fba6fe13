"""A clone with nothing beside it must work: no file of the repository reads or links
outside it (the sibling directory the project started from is not there in CI or for
users)."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUTSIDE = "../" + "shared"  # split so that this file does not match itself


def test_no_tracked_file_points_outside_the_repository() -> None:
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    offenders = []
    for name in files:
        path = REPO / name
        if not path.is_file() or path.suffix in {".csv", ".png", ".pt"}:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if OUTSIDE in line:
                offenders.append(f"{name}:{lineno}: {line.strip()}")
    assert not offenders, "files that reach outside the repository:\n" + "\n".join(offenders)
