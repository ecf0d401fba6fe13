"""Who a job's learners run as on the local backend, and how the platform writes into
directories a learner owns without trusting what the learner left there (issue #15).

When the daemon runs as root, each job gets a uid (and a gid of the same number) of its
own from a configured range; nothing is added to /etc/passwd: the learner controller is
started with `setgid`/`setuid` (subprocess's `user=`/`group=`/`extra_groups=[]`). The
uid a job got is recorded as a claim file `<data dir>/jobs/.uids/<uid>` holding the job
id, created with O_EXCL so that two guardians never hand out the same uid, and found
again by a restarted guardian or daemon; a machine-wide mark (`machine_claims_dir()`,
`/var/lib/rhizome-uid-claims/<uid>` naming the jobs directory) keeps another platform of
the same machine (another data directory) from handing out the same uid. A uid is never handed to another job while the
claim exists (the first job's files would become the second's). A job that ends for good
(completed, failed, deleted) releases its uid (`release_uid`): every process of the uid is
killed, every file of the uid in the job's trees is handed to the daemon, then the claim
goes; claims whose job ended while no guardian could release them (a crash) are released
by the next guardian to start (`release_stale_claims`). When the daemon is not
root, the learners run as the daemon's own user: the job directories are still private
to that user, but jobs are not isolated from each other (docs/security.md).

`RHIZOME_LEARNER_UIDS` configures it: `auto` (the default: a uid per job from
20000-29999 when root), `FIRST-LAST` (another range), or `off` (learners run as the
daemon's user, even root; only for a machine where every job is trusted). Another uid
must be able to enter the data directory and read the interpreter (with its standard
library) and the platform's code; where it cannot (a Python under root's 0700 home),
`auto` runs the learners as the daemon's user and logs a warning naming the directory,
and an explicit range fails the deploy with that message. `RHIZOME_LEARNER_PYTHON`
names another interpreter for the learners (default: the daemon's).

The guardian (root) keeps writing into a job's directory after the learner took it
over: spec.json and controller.log on every (re)start, the secrets file, and it reads
the learner's logs for the job record. A learner could have replaced any of those paths
with a symbolic or hard link to a file of root's, so every such access walks down from
the job directory with O_NOFOLLOW and refuses links and anything but regular files.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import stat
import sys
import sysconfig
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

UIDS_VARIABLE = "RHIZOME_LEARNER_UIDS"
DEFAULT_UID_RANGE = (20000, 29999)
CLAIMS_DIR = ".uids"  # under <data dir>/jobs, owned by the daemon, mode 0700
# Every platform of this machine marks the uids its jobs claimed here (`<uid>` holding the
# claiming jobs directory): two data directories must never hand out the same uid, or
# their jobs could read each other's files and one's release (which kills every process
# of the uid) would kill the other's learners. Persistent, like the claims it mirrors: a
# halted job keeps its uid across a reboot.
MACHINE_CLAIMS_VARIABLE = "RHIZOME_MACHINE_UID_CLAIMS"
DEFAULT_MACHINE_CLAIMS = "/var/lib/rhizome-uid-claims"


class IsolationError(RuntimeError):
    """A job cannot be isolated as configured; the message says what to change."""


class UnsafePath(IsolationError):
    """A path under a job directory is a link or not what the platform created there."""


@dataclass(frozen=True)
class IsolationConfig:
    """Where per-job uids come from; `uid_range` None means the daemon's own user."""

    uid_range: tuple[int, int] | None
    # An explicit range must hold; `auto` falls back to the daemon's user where the
    # learner uids cannot reach the interpreter, the code or the data directory.
    strict: bool = False

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] = os.environ, root: bool | None = None
    ) -> IsolationConfig:
        root = os.geteuid() == 0 if root is None else root
        raw = environ.get(UIDS_VARIABLE, "auto").strip().lower()
        if raw == "off":
            return cls(None)
        if raw == "auto":
            return cls(DEFAULT_UID_RANGE if root else None)
        first, sep, last = raw.partition("-")
        if not sep or not first.isdigit() or not last.isdigit():
            raise IsolationError(
                f"{UIDS_VARIABLE}={raw!r} must be auto, off or FIRST-LAST (e.g. 20000-29999)"
            )
        lo, hi = int(first), int(last)
        if not 1000 <= lo <= hi < 2**31 - 1:
            raise IsolationError(
                f"{UIDS_VARIABLE}={raw!r}: the range must lie within 1000-2147483646, "
                "first <= last, above the system accounts"
            )
        if not root:
            raise IsolationError(
                f"{UIDS_VARIABLE}={raw!r} needs the daemon to run as root (to switch to "
                "those uids); unset it to run learners as the daemon's own user"
            )
        return cls((lo, hi), strict=True)


@dataclass(frozen=True)
class LearnerUser:
    """The uid and gid a job's learners run as."""

    uid: int
    gid: int

    @property
    def switches(self) -> bool:
        """Whether starting a learner changes user (the daemon is root, the learner not)."""
        return self.uid != os.geteuid()

    @property
    def owner(self) -> tuple[int, int]:
        return self.uid, self.gid


def learner_user(config: IsolationConfig, jobs_dir: Path, job_id: str) -> LearnerUser:
    """The user job `job_id`'s learners run as: its claimed uid, or the daemon's own."""
    if config.uid_range is None:
        return LearnerUser(os.getuid(), os.getgid())
    uid = claim_uid(jobs_dir, job_id, *config.uid_range)
    return LearnerUser(uid, uid)


def claimed_uid(jobs_dir: Path, job_id: str) -> int | None:
    """The uid job `job_id` claimed earlier, if any."""
    claims = jobs_dir / CLAIMS_DIR
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(claims):
            if entry.name.isdigit() and _read_small(entry.path) == job_id:
                return int(entry.name)
    return None


def machine_claims_dir(environ: Mapping[str, str] = os.environ) -> Path:
    return Path(environ.get(MACHINE_CLAIMS_VARIABLE) or DEFAULT_MACHINE_CLAIMS)


def _read_mark(mark: Path) -> str:
    """A mark's jobs directory (a path: longer than a claim's job id)."""
    try:
        return mark.read_text(encoding="utf-8")[:4096].strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _mark_for_machine(uid: int, jobs_dir: Path) -> bool:
    """Mark `uid` as this jobs directory's for every platform of the machine: True if it
    is now (or already was) ours, False if another data directory holds it. A mark whose
    data directory no longer claims the uid (released, or the directory removed) is
    stale and taken over."""
    marks = machine_claims_dir()
    marks.mkdir(mode=0o700, parents=True, exist_ok=True)
    mark = marks / str(uid)
    me = str(jobs_dir.resolve())
    for _ in range(2):
        try:
            fd = os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            holder = _read_mark(mark)
            if holder == me:
                return True
            if holder and (Path(holder) / CLAIMS_DIR / str(uid)).exists():
                return False
            # stale; re-read just before removing it, so a fresh mark is not taken
            if _read_mark(mark) == holder:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(mark)
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(me)
        return True
    return False


def _unmark_for_machine(uid: int, jobs_dir: Path) -> None:
    mark = machine_claims_dir() / str(uid)
    with contextlib.suppress(FileNotFoundError):
        if _read_mark(mark) == str(jobs_dir.resolve()):
            os.unlink(mark)


def claim_uid(jobs_dir: Path, job_id: str, first: int, last: int) -> int:
    """Job `job_id`'s uid: the one it claimed before, else the lowest free one in range
    that no account of this machine uses and no other platform of the machine claimed
    (`machine_claims_dir`)."""
    earlier = claimed_uid(jobs_dir, job_id)
    if earlier is not None:
        _mark_for_machine(earlier, jobs_dir)  # a claim made before the machine-wide marks
        return earlier
    claims = jobs_dir / CLAIMS_DIR
    claims.mkdir(mode=0o700, parents=True, exist_ok=True)
    taken = {int(n) for n in os.listdir(claims) if n.isdigit()}
    for uid in range(first, last + 1):
        if uid in taken or _is_account(uid):
            continue
        if not _mark_for_machine(uid, jobs_dir):
            continue  # another platform's job runs under it
        try:
            fd = os.open(claims / str(uid), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another guardian took it a moment ago
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(job_id)
        return uid
    raise IsolationError(
        f"every learner uid of {first}-{last} is claimed by a job (claims in {claims}); "
        f"widen {UIDS_VARIABLE} or remove the claims of jobs whose directories are gone"
    )


def release_uid(
    jobs_dir: Path, job_id: str, trees: Sequence[Path], kill: Callable[[int], None]
) -> int | None:
    """Give job `job_id`'s uid back to the range; the uid, or None if it had no claim.

    In this order, so that the next job given the uid inherits nothing: `kill(uid)` (no
    process of the uid can create a file after it), every file and directory of the uid
    under `trees` (the job directory, its checkpoint directory and result store) is
    chowned to the daemon without following links, `kill(uid)` again (a process that was
    inside a system call at the first kill), and only then the claim file goes. A failure
    leaves the claim in place (the uid stays out of the range; the next start retries)."""
    uid = claimed_uid(jobs_dir, job_id)
    if uid is None:
        return None
    kill(uid)
    daemon = (os.geteuid(), os.getegid())
    for tree in trees:
        _hand_over(Path(tree), uid, daemon)
    kill(uid)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(jobs_dir / CLAIMS_DIR / str(uid))
    _unmark_for_machine(uid, jobs_dir)
    return uid


def _hand_over(tree: Path, uid: int, owner: tuple[int, int]) -> None:
    """Every entry of `tree` (itself included) owned by `uid` becomes `owner`'s; links are
    chowned themselves, never followed, and never descended."""
    if not tree.exists() and not tree.is_symlink():
        return
    entries = [tree]
    if tree.is_dir() and not tree.is_symlink():
        for top, dirs, files in os.walk(tree, followlinks=False):
            entries.extend(Path(top, n) for n in dirs + files)
    for entry in entries:
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(entry).st_uid == uid:
                os.lchown(entry, *owner)


def claims(jobs_dir: Path) -> dict[int, str]:
    """Every uid claim: uid -> the job id that holds it."""
    found: dict[int, str] = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(jobs_dir / CLAIMS_DIR):
            if entry.name.isdigit():
                found[int(entry.name)] = _read_small(entry.path)
    return found


def release_stale_claims(
    jobs_dir: Path,
    ended: Callable[[str], bool],
    trees: Callable[[str], Sequence[Path]],
    kill: Callable[[int], None],
) -> list[int]:
    """Release the uid of every claim whose job `ended` says is over for good (or whose
    claim file names no job); the uids released."""
    released = []
    for uid, job_id in sorted(claims(jobs_dir).items()):
        if job_id and not ended(job_id):
            continue
        if not job_id:  # an empty or unreadable claim: nothing can own it
            kill(uid)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(jobs_dir / CLAIMS_DIR / str(uid))
            _unmark_for_machine(uid, jobs_dir)
            released.append(uid)
            continue
        if release_uid(jobs_dir, job_id, trees(job_id), kill) is not None:
            released.append(uid)
    return released


# Where `reachable_python` looks for an interpreter other uids may run, in this order:
# the system's own installs of the daemon's Python version.
SYSTEM_PYTHON_DIRS = ("/usr/bin", "/usr/local/bin")
SHIM_DIR = "learner-python"  # under the data directory: root's, 0755


def reachable_python(
    data_dir: Path, user: LearnerUser, search: Sequence[str] = SYSTEM_PYTHON_DIRS
) -> Path | None:
    """An interpreter `user` can run with the daemon's packages, for a daemon whose own
    Python `user` cannot reach (a pyenv build under root's 0700 home); None if there is
    none. It is the system's Python of the daemon's version (same major.minor, so the
    same ABI for compiled packages), run by a wrapper `<data dir>/learner-python/bin/python`
    that adds the daemon's site-packages (and the .pth files there, the platform's
    editable install included) through a `sitecustomize` — nothing is copied, and
    nothing of the daemon's private home is opened to others."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site_packages = Path(sysconfig.get_paths()["purelib"])
    if unreachable(site_packages, user) is not None or not readable(site_packages, user):
        return None
    for folder in search:
        candidate = Path(folder) / version
        if not candidate.is_file():
            continue
        real = candidate.resolve()
        if unreachable(real.parent, user) is not None or not os.stat(real).st_mode & 0o001:
            continue
        root = data_dir / SHIM_DIR
        for sub in (root, root / "site", root / "bin"):
            sub.mkdir(mode=0o755, exist_ok=True)
            set_mode(sub, 0o755)
        _put(
            root / "site" / "sitecustomize.py",
            f"import site\nsite.addsitedir({str(site_packages)!r})\n",
            0o644,
        )
        # The job's own PYTHONPATH, if any, comes after the daemon's packages' hook.
        _put(
            root / "bin" / "python",
            f'#!/bin/sh\nPYTHONPATH={root / "site"}${{PYTHONPATH:+:$PYTHONPATH}} exec {real} "$@"\n',
            0o755,
        )
        return root / "bin" / "python"
    return None


def _put(path: Path, text: str, mode: int) -> None:
    """`path` holds `text` with `mode`, replaced atomically when it differs."""
    with contextlib.suppress(OSError):
        if path.read_text() == text and stat.S_IMODE(path.lstat().st_mode) == mode:
            return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _is_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def _read_small(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read(256).strip()
    except (OSError, UnicodeDecodeError):
        return ""


def unreachable(path: Path, user: LearnerUser) -> Path | None:
    """The first directory on the way to `path` (itself included) that `user` may not
    enter, judged from the mode bits as the kernel would; None when every one is."""
    path = Path(os.path.abspath(path))
    for directory in [*reversed(path.parents), path]:
        try:
            st = os.stat(directory)
        except OSError:
            return directory
        if not _may(st, user, stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH):
            return directory
    return None


def data_dir_fallback(data_dir: Path, environ: Mapping[str, str] = os.environ) -> str | None:
    """Why `auto` will run this data directory's learners as the daemon's own user (a
    directory on the way to it that learner uids cannot enter), with the fix; None when
    it will not. `rhizome up` says it: the backend's own warning reaches only a guardian
    host's log, while the learners run as root."""
    try:
        config = IsolationConfig.from_env(environ)
    except IsolationError:
        return None  # every deploy fails saying so
    if config.uid_range is None or config.strict:
        return None  # no uids to switch to, or an explicit range: a deploy fails instead
    learner = LearnerUser(config.uid_range[0], config.uid_range[0])
    # The data directory itself is opened to traversal at each deploy (0711).
    blocked = unreachable(Path(data_dir).resolve().parent, learner)
    if blocked is None:
        return None
    return (
        f"learners will run as root, not isolated from each other: uid {learner.uid} cannot "
        f"enter {blocked} on the way to the data directory {data_dir}; chmod o+x {blocked}, "
        f"or use a data directory others may traverse (e.g. --data-dir /var/lib/rhizome), "
        f"or set {UIDS_VARIABLE}=off to make running them as root your choice"
    )


def readable(path: Path, user: LearnerUser) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return _may(st, user, stat.S_IRUSR, stat.S_IRGRP, stat.S_IROTH)


def writable(path: Path, user: LearnerUser) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return _may(st, user, stat.S_IWUSR, stat.S_IWGRP, stat.S_IWOTH) and _may(
        st, user, stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH
    )


def _may(st: os.stat_result, user: LearnerUser, usr: int, grp: int, oth: int) -> bool:
    if user.uid == 0:
        return True
    if st.st_uid == user.uid:
        return bool(st.st_mode & usr)
    if st.st_gid == user.gid:
        return bool(st.st_mode & grp)
    return bool(st.st_mode & oth)


# -- writing beneath a directory a learner owns -------------------------------------------
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@contextlib.contextmanager
def directory(
    root: Path, parts: Sequence[str] = (), owner: tuple[int, int] | None = None, mode: int = 0o700
) -> Iterator[int]:
    """A descriptor of `root/parts...`, created (mode `mode`, chowned to `owner`) where
    missing. `root` itself must not be a link; no component below it may be one."""
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError as exc:
        raise UnsafePath(f"{root} is not a directory the platform made: {exc.strerror}") from exc
    try:
        where = Path(root)
        for part in parts:
            where = where / part
            created = False
            try:
                os.mkdir(part, mode, dir_fd=fd)
                created = True
            except FileExistsError:
                pass
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePath(f"{where} is a link or not a directory; refused") from exc
                raise
            os.close(fd)
            fd = child
            if created and owner is not None:
                os.fchown(fd, *owner)
        yield fd
    finally:
        os.close(fd)


def _check_regular(fd: int, where: Path) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        raise UnsafePath(f"{where} is not a plain file of its own (a link or a device); refused")


def write_file(
    root: Path,
    parts: Sequence[str],
    name: str,
    data: bytes,
    mode: int,
    owner: tuple[int, int] | None,
) -> Path:
    """Write `root/parts.../name` atomically (a new file renamed over the old one), with
    `mode` and `owner`; whatever link a learner left at that name is replaced, not
    followed."""
    with directory(root, parts, owner) as dfd:
        tmp = f".{name}.tmp-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dfd)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
        try:
            os.write(fd, data)
            os.fchmod(fd, mode)
            if owner is not None:
                os.fchown(fd, *owner)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    return Path(root, *parts, name)


def open_append(root: Path, parts: Sequence[str], name: str, owner: tuple[int, int] | None) -> int:
    """A descriptor appending to `root/parts.../name` (created 0600 for `owner`)."""
    with directory(root, parts, owner) as dfd:
        where = Path(root, *parts, name)
        try:
            fd = os.open(
                name,
                os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK,
                0o600,
                dir_fd=dfd,
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePath(f"{where} is a link; refused") from exc
            raise
        try:
            _check_regular(fd, where)
            if owner is not None and os.fstat(fd).st_uid != owner[0]:
                os.fchown(fd, *owner)
        except BaseException:
            os.close(fd)
            raise
        return fd


def read_tail(root: Path, parts: Sequence[str], name: str, limit: int) -> bytes:
    """The last `limit` bytes of `root/parts.../name`, refusing links (b"" if missing)."""
    try:
        with directory(root, parts) as dfd:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except FileNotFoundError:
        return b""
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath(f"{Path(root, *parts, name)} is a link; refused") from exc
        raise
    try:
        _check_regular(fd, Path(root, *parts, name))
        size = os.fstat(fd).st_size
        os.lseek(fd, max(0, size - limit), os.SEEK_SET)
        return os.read(fd, limit)
    finally:
        os.close(fd)


def own_directory(path: Path, owner: tuple[int, int], mode: int = 0o700) -> None:
    """`path` (whose parent the platform owns) belongs to `owner` with `mode`."""
    with directory(path) as fd:
        st = os.fstat(fd)
        if (st.st_uid, st.st_gid) != owner:
            os.fchown(fd, *owner)
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)


def restrict(path: Path, mode: int) -> None:
    """Take away the mode bits beyond `mode` of a file or directory this process owns."""
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        kind = stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)  # not sockets, links
        if st.st_uid == os.geteuid() and kind:
            current = stat.S_IMODE(st.st_mode)
            if current & ~mode:
                os.chmod(path, current & mode)


def set_mode(path: Path, mode: int) -> None:
    """A directory this process owns gets exactly `mode` (others' bits included)."""
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        mine = stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
        if mine and stat.S_IMODE(st.st_mode) != mode:
            os.chmod(path, mode)


__all__ = [
    "DEFAULT_UID_RANGE",
    "UIDS_VARIABLE",
    "IsolationConfig",
    "IsolationError",
    "LearnerUser",
    "UnsafePath",
    "claim_uid",
    "claimed_uid",
    "claims",
    "data_dir_fallback",
    "directory",
    "learner_user",
    "open_append",
    "own_directory",
    "reachable_python",
    "read_tail",
    "readable",
    "release_stale_claims",
    "release_uid",
    "restrict",
    "set_mode",
    "unreachable",
    "writable",
    "write_file",
]
