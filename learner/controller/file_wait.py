"""Waiting for files to be written, without polling them: Linux inotify through ctypes.

The log collector (collector.py) tails the learner's `stdout.log` and `stderr.log`. A
collector that polls them every 50 ms wakes 20 times a second for nothing while the
learner is quiet, on cores the learner's workers need (issue #16: two pinned pipeline
workers use both cores of the development machine). `FileWait` blocks instead until one
of the watched files is written (or created, or replaced: the directory is watched, so a
file that does not exist yet is seen when it appears), until `interrupt()`, or until a
timeout.

Where inotify cannot be had (not Linux, no libc symbol, the user's inotify instances or
watches used up: `fs.inotify.max_user_instances` is often 128, one a collector)
`FileWait.open` returns None and the caller polls as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import struct
import threading
import time
from collections.abc import Sequence
from pathlib import Path

# <sys/inotify.h>
IN_MODIFY = 0x00000002
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_MASK = IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then `len` bytes of name


class FileWait:
    """Wakes `wait` when one of `paths` is written; the files' directories are watched
    (events of other files there, such as the collector's own offsets file, are read
    and ignored)."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.names = {os.fsencode(Path(p).name) for p in paths}
        libc = ctypes.CDLL(None, use_errno=True)
        fd = int(libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self._fd = fd
        self._lock = threading.Lock()  # interrupt() from other threads against close()
        self._closed = False
        # Set when the kernel dropped events (queue overflow) or a directory's watch went
        # away: the caller cannot rely on the wake-ups any more and polls.
        self.broken = False
        try:
            for folder in sorted({Path(p).parent for p in paths}):
                if libc.inotify_add_watch(fd, os.fsencode(folder), _MASK) < 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"inotify_add_watch {folder}: {os.strerror(err)}")
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open(cls, paths: Sequence[Path]) -> FileWait | None:
        """A FileWait for `paths`, or None where inotify is not available."""
        try:
            return cls(paths)
        except (OSError, AttributeError):  # AttributeError: no inotify in this libc
            return None

    def _written(self) -> bool:
        """Read every queued event; True if one is about a watched file."""
        hit = False
        while True:
            try:
                data = os.read(self._fd, 64 * 1024)
            except BlockingIOError:
                return hit
            offset = 0
            while offset + _EVENT.size <= len(data):
                _wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                name = data[offset + _EVENT.size : offset + _EVENT.size + length].rstrip(b"\0")
                offset += _EVENT.size + length
                if mask & (IN_Q_OVERFLOW | IN_IGNORED):
                    self.broken = True
                    hit = True
                elif name in self.names:
                    hit = True

    def clear(self) -> None:
        """Forget the events so far: call it right before reading the files, so that a
        later `wait` wakes only for what is written after that read."""
        self._written()

    def wait(self, timeout_s: float) -> bool:
        """Block until a watched file is written (True), `interrupt()` is called or
        `timeout_s` passes (False). Returns at once after a write not yet cleared."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            ready, _, _ = select.select([self._fd, self._wake_r], [], [], remaining)
            if self._wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
                return False
            if self._fd in ready and self._written():
                return True

    def interrupt(self) -> None:
        """Wake a `wait` now (from any thread; a no-op once closed)."""
        with self._lock, contextlib.suppress(BlockingIOError, OSError):
            if not self._closed:
                os.write(self._wake_w, b"x")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in (self._fd, self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
