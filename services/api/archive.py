"""Checks on an uploaded code archive (the FfDL "model definition" zip) before it is stored.

A zip's central directory says what it would expand to, so the cheap checks run on it
first: member count, each member's and the total uncompressed size, the compression
ratio (a 10 KB zip that expands to 10 GB is a bomb, not code), file types and paths.
Only an archive that passes is decompressed once, in chunks, to verify every CRC; a
member's reader stops at its declared size, so a directory that lies about sizes cannot
make that pass expand further than the limits allow. The limits are `contract.archive`'s: the learner's controller enforces
the same ones again on the bytes it writes when it extracts the archive.
"""

from __future__ import annotations

import io
import stat
import struct
import zipfile
import zlib
from typing import IO

from contract.archive import DEFAULT_ARCHIVE_LIMITS, ArchiveLimits, unsafe_name
from services.api import errors

# Everything zipfile raises on a damaged or hostile archive (hypothesis found several).
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    EOFError,
    OSError,
    NotImplementedError,
    RuntimeError,  # an encrypted member
    UnicodeDecodeError,  # a name that is not valid UTF-8 despite its flag
    ValueError,
    struct.error,
    zlib.error,
)


def check_archive(data: bytes | IO[bytes], limits: ArchiveLimits = DEFAULT_ARCHIVE_LIMITS) -> int:
    """Raise BadRequest/TooLarge naming what is wrong and the limit; return the number of
    files in a valid archive. `data` is the archive's bytes or a seekable file of them
    (a streamed upload spooled to disk): the same checks either way."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(data) if isinstance(data, bytes) else data)
    except _ZIP_ERRORS:
        raise errors.BadRequest("model definition is not a valid zip archive") from None
    with zf:
        infos = zf.infolist()
        if len(infos) > limits.max_members:
            raise errors.TooLarge(
                f"model definition zip has {len(infos)} members; at most {limits.max_members}"
            )
        for info in infos:
            why = unsafe_name(info.filename)
            if why:
                raise errors.BadRequest(
                    f"model definition zip member {info.filename!r} has {why}; "
                    "use relative paths inside the archive"
                )
        files = [i for i in infos if not i.is_dir()]
        if not files:
            raise errors.BadRequest(
                "model definition zip is empty; zip the folder with your training code"
            )
        seen: set[str] = set()
        total = 0
        for info in infos:
            if info.filename in seen:
                raise errors.BadRequest(
                    f"model definition zip has {info.filename!r} twice; each path once"
                )
            seen.add(info.filename)
            # Unix mode bits; a file type of 0 means none was recorded (Windows zips,
            # Python's writestr): a plain file.
            mode = info.external_attr >> 16
            if stat.S_IFMT(mode) not in (0, stat.S_IFREG, stat.S_IFDIR):
                kind = "a symbolic link" if stat.S_ISLNK(mode) else "a special file"
                raise errors.BadRequest(
                    f"model definition zip member {info.filename!r} is {kind}; "
                    "only regular files and folders are accepted"
                )
            if info.file_size > limits.max_member_bytes:
                raise errors.TooLarge(
                    f"model definition zip member {info.filename!r} expands to "
                    f"{info.file_size} bytes; at most {limits.max_member_bytes} per file"
                )
            total += info.file_size
            if total > limits.max_total_bytes:
                raise errors.TooLarge(
                    f"model definition zip expands to more than {limits.max_total_bytes} "
                    "bytes; put data in a data store, not in the code archive"
                )
            if info.file_size > 1024 * 1024 and info.file_size > limits.max_ratio * max(
                info.compress_size, 1
            ):
                raise errors.TooLarge(
                    f"model definition zip member {info.filename!r} is compressed "
                    f"{info.file_size // max(info.compress_size, 1)}:1; at most "
                    f"{limits.max_ratio:.0f}:1 (that is a zip bomb, not code)"
                )
        for info in files:
            try:
                with zf.open(info) as member:
                    while member.read(1024 * 1024):
                        pass
            except _ZIP_ERRORS as exc:
                raise errors.BadRequest(
                    f"model definition zip is corrupt at {info.filename!r}: {exc}"
                ) from None
    return len(files)
