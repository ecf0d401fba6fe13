"""Tailing a growing text file by byte offset, with a deterministic notion of a line.

Determinism is what makes restarts exact: re-reading from a committed offset must cut the
same lines again. A line ends at `\n`; a line longer than `max_line_bytes` is cut into
pieces of that size (whether or not its end has been written yet); an unterminated last
line is held back until more bytes come or the learner is done (`final`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO


class LineTailer:
    def __init__(self, path: Path, offset: int = 0, max_line_bytes: int = 64 * 1024) -> None:
        self.path = Path(path)
        self.offset = offset  # file offset of the first byte not yet returned as a line
        self.max_line_bytes = max_line_bytes
        self._f: BinaryIO | None = None
        self._ino: int | None = None
        self._buf = b""  # bytes read from the file starting at self.offset
        self.truncations = 0

    def seek(self, offset: int) -> None:
        self.offset = offset
        self._buf = b""

    def _open(self) -> BinaryIO | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        if self._f is not None and st.st_ino != self._ino:
            self._f.close()
            self._f = None
        if st.st_size < self.offset + len(self._buf):
            # Truncated or replaced by a shorter file: start over at its beginning.
            self.truncations += 1
            self.offset, self._buf = 0, b""
        if self._f is None:
            self._f = open(self.path, "rb")  # noqa: SIM115 - kept open across reads
            self._ino = st.st_ino
        return self._f

    def read_lines(self, max_lines: int, final: bool = False) -> list[str]:
        f = self._open()
        if f is None:
            return []
        out: list[str] = []
        limit = self.max_line_bytes
        while len(out) < max_lines:
            # at exactly the limit, one more byte says whether the line is over-long
            if b"\n" not in self._buf and len(self._buf) <= limit:
                f.seek(self.offset + len(self._buf))
                chunk = f.read(1 << 20)
                if chunk:
                    self._buf += chunk
                    continue
            pieces = self._buf.split(b"\n", max_lines - len(out))
            rest = pieces.pop()  # unterminated (or beyond max_lines)
            consumed = 0
            for raw in pieces:
                consumed += len(raw) + 1
                while len(raw) > limit:
                    out.append(_decode(raw[:limit]))
                    raw = raw[limit:]
                out.append(_decode(raw))
            self._buf = self._buf[consumed:]
            self.offset += consumed
            if pieces:
                continue
            # No newline in the buffer: cut an over-long line, or wait for its end. A line
            # of exactly the limit is whole, as when its newline is already there.
            if len(rest) > limit:
                out.append(_decode(rest[:limit]))
                self._buf = rest[limit:]
                self.offset += limit
                continue
            if final and rest:
                f.seek(self.offset + len(self._buf))
                more = f.read(1 << 20)
                if more:
                    self._buf += more
                    continue
                out.append(_decode(rest))
                self.offset += len(rest)
                self._buf = b""
            break
        return out

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _decode(raw: bytes) -> str:
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    return raw.decode("utf-8", "replace")
