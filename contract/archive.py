"""The limits on a job's code archive (the FfDL "model definition" zip).

One set of numbers for both sides: the API checks an upload against them before storing
it (`services/api/archive.py`), and the learner controller enforces them again while it
extracts the archive it fetched (`learner/controller/fetch.py`), counting the bytes it
really writes, since an archive in an object store may not be the one that was checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ArchiveLimits:
    max_members: int = 10_000
    max_member_bytes: int = 512 * 1024 * 1024
    max_total_bytes: int = 1024 * 1024 * 1024
    # Ratio of uncompressed to compressed size, checked on members above 1 MiB: source
    # code compresses 3-10x; a bomb 1,000x and more.
    max_ratio: float = 200.0


DEFAULT_ARCHIVE_LIMITS = ArchiveLimits()

_DRIVE = re.compile(r"^[A-Za-z]:")


def unsafe_name(name: str) -> str | None:
    """Why a member name could write outside the job's code directory, or None."""
    if not name:
        return "an empty name"
    if "\x00" in name:
        return "a NUL byte in the name"
    if "\\" in name:
        return "a backslash (zip paths use '/')"
    if name.startswith("/") or _DRIVE.match(name):
        return "an absolute path"
    if ".." in name.split("/"):
        return "a '..' component"
    return None
