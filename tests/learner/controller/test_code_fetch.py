"""The learner controller's code download (learner/controller/fetch.py): the archive
limits of `contract.archive` enforced on extraction, a full disk, the object store with
the job's own credentials, and a controller whose code cannot be had ending FAILED with
the reason. Every failure leaves neither a code directory nor a partial extraction."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from contract import etcd_keys
from contract.archive import ArchiveLimits
from contract.etcd import EtcdClient
from contract.learner_spec import LearnerSpec
from contract.procs import stop_process_group
from learner.controller.fetch import COMPLETE_MARKER, CodeFetchError, fetch_code
from services.objectstore.s3 import S3ObjectStore
from tests.services.objectstore.server import MotoS3

REPO = Path(__file__).resolve().parents[3]


def make_zip(members: dict[str, bytes], *, symlink: str = "") -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        if symlink:
            info = zipfile.ZipInfo(symlink)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, "/etc/passwd")
    return buf.getvalue()


def spec_for(
    job_dir: Path, model_zip: str = "", storage: dict[str, object] | None = None
) -> LearnerSpec:
    return LearnerSpec(
        job_id="jfetch",
        rank=0,
        world_size=1,
        job_dir=str(job_dir),
        command="true",
        etcd_url="",
        model_zip=model_zip,
        storage=dict(storage or {}),
    )


def left_behind(job_dir: Path) -> list[str]:
    return sorted(p.name for p in job_dir.iterdir()) if job_dir.exists() else []


def test_extracts_the_archive_completely(tmp_path: Path) -> None:
    archive = tmp_path / "code.zip"
    archive.write_bytes(make_zip({"train.py": b"print(1)\n", "pkg/util.py": b"X = 1\n"}))
    job_dir = tmp_path / "job"
    fetch_code(spec_for(job_dir, str(archive)))
    code = job_dir / "code"
    assert (code / "train.py").read_bytes() == b"print(1)\n"
    assert (code / "pkg" / "util.py").read_bytes() == b"X = 1\n"
    assert (code / COMPLETE_MARKER).exists()
    assert left_behind(job_dir) == ["code"]


@pytest.mark.parametrize(
    ("members", "symlink", "limits", "why"),
    [
        ({"../evil.py": b"x"}, "", ArchiveLimits(), "a '..' component"),
        ({"/etc/evil": b"x"}, "", ArchiveLimits(), "an absolute path"),
        ({"ok.py": b"x"}, "link", ArchiveLimits(), "not a regular file"),
        ({f"f{i}.py": b"x" for i in range(5)}, "", ArchiveLimits(max_members=3), "5 members"),
        ({"big.bin": b"a" * 4096}, "", ArchiveLimits(max_member_bytes=1000), "past 1000 bytes"),
        (
            {"a.py": b"a" * 600, "b.py": b"b" * 600},
            "",
            ArchiveLimits(max_total_bytes=1000),
            "put data in a data store",
        ),
        ({"bomb.bin": b"\0" * (8 * 1024 * 1024)}, "", ArchiveLimits(), "zip bomb"),
    ],
    ids=["dotdot", "absolute", "symlink", "members", "member-size", "total-size", "ratio"],
)
def test_archive_limits_are_enforced_on_extraction(
    tmp_path: Path,
    members: dict[str, bytes],
    symlink: str,
    limits: ArchiveLimits,
    why: str,
) -> None:
    archive = tmp_path / "code.zip"
    archive.write_bytes(make_zip(members, symlink=symlink))
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    with pytest.raises(CodeFetchError, match=why):
        fetch_code(spec_for(job_dir, str(archive)), limits)
    assert left_behind(job_dir) == []


def test_not_a_zip(tmp_path: Path) -> None:
    archive = tmp_path / "code.zip"
    archive.write_bytes(b"this is not a zip")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    with pytest.raises(CodeFetchError, match="not a valid zip archive"):
        fetch_code(spec_for(job_dir, str(archive)))
    assert left_behind(job_dir) == []


@pytest.fixture()
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs: a disk that fills up. Mounting needs root (as `make test` runs
    here); without it the test fails saying so rather than pretending."""
    if os.geteuid() != 0:
        pytest.fail("the full-disk test mounts a 1 MiB tmpfs and needs root; run it as root")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_fails_clearly_and_leaves_nothing(small_disk: Path, tmp_path: Path) -> None:
    archive = tmp_path / "code.zip"
    # Incompressible, so the ratio check passes and the disk is what stops it.
    archive.write_bytes(make_zip({"weights.bin": os.urandom(3 * 1024 * 1024)}))
    job_dir = small_disk / "job"
    job_dir.mkdir()
    with pytest.raises(CodeFetchError, match="is full while extracting"):
        fetch_code(spec_for(job_dir, str(archive)))
    assert left_behind(job_dir) == []
    usage = os.statvfs(small_disk)
    assert usage.f_bfree == usage.f_blocks  # every byte written was removed


@pytest.fixture(scope="module")
def moto_s3() -> Iterator[MotoS3]:
    server = MotoS3().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.integration
def test_fetches_from_the_object_store_with_the_jobs_credentials(
    moto_s3: MotoS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in moto_s3.platform_env.items():
        monkeypatch.setenv(key, value)
    store = S3ObjectStore(moto_s3.bucket, "fetch", endpoint_url=moto_s3.url)
    store.put("models/jfetch.zip", make_zip({"train.py": b"print('from s3')\n"}))
    access = store.grant("jfetch", with_model=True, ttl_s=3600)
    # The learner has no platform credentials: only what its spec carries.
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    job_dir = tmp_path / "job"
    fetch_code(spec_for(job_dir, storage=access.to_dict()))
    assert (job_dir / "code" / "train.py").read_bytes() == b"print('from s3')\n"
    assert left_behind(job_dir) == ["code"]

    store.revoke("jfetch")
    other = tmp_path / "other"
    with pytest.raises(CodeFetchError, match=r"refused the job.s credentials"):
        fetch_code(spec_for(other, storage=access.to_dict()))
    assert left_behind(other) == []


@pytest.mark.integration
def test_the_controller_fails_the_learner_with_the_reason(
    etcd_server: object, tmp_path: Path
) -> None:
    """`python -m learner.controller` with an archive that escapes its directory: the
    learner ends FAILED naming why, the reason is in its stderr (which the guardian puts
    in the job's record), and the command never ran."""
    url = str(etcd_server.url)  # type: ignore[attr-defined]
    archive = tmp_path / "code.zip"
    archive.write_bytes(make_zip({"../../escape.py": b"x"}))
    job_dir = tmp_path / "job"
    spec = spec_for(job_dir, str(archive))
    spec.etcd_url = url
    spec.job_id = f"jfetch{os.getpid()}"
    spec.command = "touch ran"
    path = spec.learner_dir / "spec.json"
    spec.dump(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it may carry credentials
    proc = subprocess.Popen(
        [sys.executable, "-m", "learner.controller", "--spec", str(path)],
        cwd=REPO,
        start_new_session=True,
    )
    try:
        assert proc.wait(timeout=60) == 0
    finally:
        stop_process_group(proc.pid)
    value = EtcdClient(url).get(etcd_keys.learner_status(spec.job_id, 0))
    assert value is not None
    status = value.value
    assert status["status"] == "FAILED"
    assert "cannot fetch the job's code" in status["message"]
    assert "'..' component" in status["message"]
    assert "cannot fetch the job's code" in (spec.learner_dir / "stderr.log").read_text()
    assert not (job_dir / "code").exists()
    assert json.loads((spec.learner_dir / "controller.json").read_text())["phase"] == "FAILED"
