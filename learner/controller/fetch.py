"""The learner controller's code download: fetch the job's code archive (a file on a
shared volume, or an object in the platform's object store with the job's own
credentials) and extract it into the job's code directory.

Extraction enforces the archive limits of `contract.archive` (the API's, checked at
submit) again, on what is really written: the archive in the store may not be the one
that was checked. Member names that could escape the code directory, links and special
files are refused; each member's bytes are counted as they are written, so a member that
lies about its size cannot expand past the limits. Everything is extracted into a
temporary directory beside the code directory and renamed into place only when
complete: a failure (a bad archive, a full disk) removes the temporary directory and
raises `CodeFetchError`, whose message the controller records as the learner's failure.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import zipfile
from pathlib import Path
from typing import Any

from contract.archive import DEFAULT_ARCHIVE_LIMITS, ArchiveLimits, unsafe_name
from contract.learner_spec import LearnerSpec, StorageAccess

COMPLETE_MARKER = ".rhizome-complete"
_CHUNK = 1024 * 1024


class CodeFetchError(RuntimeError):
    """The job's code could not be fetched or extracted; the message says why and what
    to do. Nothing of the failed attempt is left behind."""


class ResultStoreError(RuntimeError):
    """The learner's results could not be stored; the message says where and why."""


def s3_client(access: StorageAccess) -> Any:
    """A boto3 client holding the job's credentials and nothing else (never the
    environment's)."""
    try:
        import boto3  # only learners of a job in an object store need it
        from botocore.config import Config
    except ImportError as exc:
        raise CodeFetchError(
            f"the learner cannot load boto3 ({exc}); the learner image needs the "
            "project's virtualenv and the system's TLS library (libssl3): rebuild it with "
            "`rhizome image build --rebuild-base`"
        ) from exc

    return boto3.client(
        "s3",
        endpoint_url=access.endpoint_url,
        region_name=access.region,
        aws_access_key_id=access.access_key_id,
        aws_secret_access_key=access.secret_access_key,
        aws_session_token=access.session_token,
        config=Config(connect_timeout=5, read_timeout=60, retries={"max_attempts": 3}),
    )


def _disk_full(exc: OSError, where: Path) -> CodeFetchError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return CodeFetchError(
            f"the disk holding {where} is full while extracting the job's code; free space "
            "there or make the code archive smaller (put data in a data store)"
        )
    return CodeFetchError(f"cannot extract the job's code into {where}: {exc}")


def download_archive(access: StorageAccess, dest: Path) -> None:
    """The job's code archive from the object store into file `dest`."""
    if access.expired:
        raise CodeFetchError(
            "the job's storage credentials have expired; the platform issues new ones when "
            "it restarts the learner (rhizome resume)"
        )
    client = s3_client(access)
    import botocore.exceptions

    try:
        client.download_file(access.bucket, access.model_key, str(dest))
    except OSError as exc:
        raise _disk_full(exc, dest.parent) from exc
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
        where = f"s3://{access.bucket}/{access.model_key} at {access.endpoint_url}"
        code = ""
        if isinstance(exc, botocore.exceptions.ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("403", "AccessDenied", "Forbidden"):
            raise CodeFetchError(
                f"the object store refused the job's credentials for {where}: they were "
                "revoked (the job ended or its deploy was rolled back) or have expired"
            ) from exc
        if code in ("404", "NoSuchKey", "NotFound"):
            raise CodeFetchError(f"the job's code {where} does not exist") from exc
        raise CodeFetchError(f"cannot download the job's code {where}: {exc}") from exc


def extract(archive: Path, dest: Path, limits: ArchiveLimits = DEFAULT_ARCHIVE_LIMITS) -> int:
    """Extract `archive` into the empty directory `dest` within `limits`; returns the
    number of files. Raises CodeFetchError (the caller removes `dest`)."""
    try:
        zf = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError) as exc:
        raise CodeFetchError(f"the job's code archive is not a valid zip archive ({exc})") from exc
    files = 0
    total = 0
    with zf:
        infos = zf.infolist()
        if len(infos) > limits.max_members:
            raise CodeFetchError(
                f"the job's code archive has {len(infos)} members; at most {limits.max_members}"
            )
        for info in infos:
            why = unsafe_name(info.filename)
            if why:
                raise CodeFetchError(
                    f"the job's code archive member {info.filename!r} has {why}; refused"
                )
            mode = info.external_attr >> 16
            if stat.S_IFMT(mode) not in (0, stat.S_IFREG, stat.S_IFDIR):
                raise CodeFetchError(
                    f"the job's code archive member {info.filename!r} is not a regular file "
                    "or folder; refused"
                )
            target = dest / info.filename
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            written = 0
            with zf.open(info) as src, open(target, "wb") as out:
                while chunk := src.read(_CHUNK):
                    written += len(chunk)
                    total += len(chunk)
                    if written > limits.max_member_bytes:
                        raise CodeFetchError(
                            f"the job's code archive member {info.filename!r} expands past "
                            f"{limits.max_member_bytes} bytes; refused"
                        )
                    if total > limits.max_total_bytes:
                        raise CodeFetchError(
                            f"the job's code archive expands past {limits.max_total_bytes} "
                            "bytes; put data in a data store, not in the code archive"
                        )
                    if written > _CHUNK and written > limits.max_ratio * max(info.compress_size, 1):
                        raise CodeFetchError(
                            f"the job's code archive member {info.filename!r} expands more "
                            f"than {limits.max_ratio:.0f}:1 (a zip bomb, not code); refused"
                        )
                    out.write(chunk)
            files += 1
    return files


def fetch_code(spec: LearnerSpec, limits: ArchiveLimits = DEFAULT_ARCHIVE_LIMITS) -> None:
    """The job's code in `spec.code_dir`, complete, or CodeFetchError with nothing left.
    Learners of a job share the directory: the first one to finish renames it in."""
    code = spec.code_dir
    access = spec.storage_access
    has_code = bool(access.model_key if access else spec.model_zip)
    if not has_code or (code / COMPLETE_MARKER).exists():
        code.mkdir(parents=True, exist_ok=True)
        return
    tmp = code.with_name(f".code.tmp-{spec.rank}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        if access is not None:
            archive = tmp.with_name(f"{tmp.name}.zip")
            try:
                download_archive(access, archive)
                extract(archive, tmp, limits)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    archive.unlink()
        else:
            extract(Path(spec.model_zip), tmp, limits)
        (tmp / COMPLETE_MARKER).write_text(str(spec.generation))
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _disk_full(exc, code.parent) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(code)
    except OSError:  # another learner of the job extracted it first
        shutil.rmtree(tmp, ignore_errors=True)
    code.mkdir(parents=True, exist_ok=True)


def upload_results(access: StorageAccess, rank: int, source: Path) -> int:
    """Copy the learner's result directory to `<result_prefix>/<rank>/` in the store;
    returns the number of files."""
    try:
        client = s3_client(access)
    except CodeFetchError as exc:
        raise ResultStoreError(str(exc)) from exc
    import botocore.exceptions

    files = sorted(p for p in source.rglob("*") if p.is_file())
    try:
        for path in files:
            key = f"{access.result_prefix}/{rank}/{path.relative_to(source).as_posix()}"
            client.upload_file(str(path), access.bucket, key)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
        raise ResultStoreError(
            f"cannot store the results in s3://{access.bucket}/{access.result_prefix}: {exc}"
        ) from exc
    return len(files)


def storage_environ(spec: LearnerSpec) -> dict[str, str]:
    """What the user command needs to keep its checkpoints in the object store: the
    checkpoint SDK's backup URL and endpoint, and the job's credentials."""
    access = spec.storage_access
    if access is None:
        return {}
    from contract import env as learner_env

    return {
        learner_env.BACKUP_URL: access.checkpoint_url,
        learner_env.S3_ENDPOINT_URL: access.endpoint_url,
        **access.aws_environ(),
    }
