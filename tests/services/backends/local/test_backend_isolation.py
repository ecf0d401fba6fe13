"""The local backend's deploy steps under a learner uid (as root, as CI runs): who owns
what, what is closed, and the errors that name what stops a learner uid."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.backends.api import BackendError, JobSpec
from services.backends.local import isolation
from services.backends.local.backend import LocalBackend
from services.backends.local.isolation import IsolationConfig, LearnerUser
from services.manifest import parse_manifest

UIDS = IsolationConfig((47000, 47099), strict=True)


@pytest.fixture
def data_dir() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.fail("these tests need root: only root can hand a job's files to its uid")
    path = Path(tempfile.mkdtemp(prefix="rhizome-backend-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def reachable_python() -> str:
    """An interpreter other uids can run (the checks only look at its directory)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable):
        if Path(candidate).exists() and os.stat(Path(candidate).parent).st_mode & stat.S_IXOTH:
            return candidate
    pytest.fail("no Python interpreter in a directory other uids may enter")


def job(data_dir: Path, job_id: str = "job-x", **manifest: object) -> JobSpec:
    parsed = parse_manifest(json.dumps({"name": "t", "framework": {"command": "true"}, **manifest}))
    models = data_dir / "objects" / "models"
    models.mkdir(parents=True, exist_ok=True)
    (models / f"{job_id}.zip").write_bytes(b"PK\x05\x06" + b"\0" * 18)  # an empty zip
    (data_dir / "jobs" / job_id).mkdir(parents=True, exist_ok=True)
    return JobSpec(
        manifest=parsed,
        job_id=job_id,
        command="true",
        learners=1,
        job_dir=str(data_dir / "jobs" / job_id),
        checkpoint_dir=str(data_dir / "jobs" / job_id / "checkpoints"),
        result_store=str(data_dir / "objects" / "results" / job_id),
        etcd_url="http://127.0.0.1:1",
        model_zip=str(models / f"{job_id}.zip"),
    )


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_job_directory_secrets_and_results_are_the_job_uids_alone(data_dir: Path) -> None:
    spec = job(
        data_dir,
        data_stores=[{"id": "s3", "type": "s3_datastore", "connection": {"password": "pw"}}],
    )
    (data_dir / "admin.token").write_text("secret")
    (data_dir / "admin.token").chmod(0o644)
    backend = LocalBackend(python=reachable_python(), isolation_config=UIDS)
    backend.prepare_volume(spec)
    backend.write_secrets(spec)
    uid = backend.learner_user(spec).uid
    assert 47000 <= uid <= 47099
    root = Path(spec.job_dir)
    assert (root.stat().st_uid, mode(root)) == (uid, 0o700)
    for sub in ("checkpoints", "learners", "results", "data"):
        assert (root / sub).stat().st_uid == uid, sub
    secrets = root / "secrets" / "env"
    assert (secrets.stat().st_uid, mode(secrets)) == (uid, 0o400)
    assert secrets.read_text() == "S3_PASSWORD=pw\n"
    archive = root / "model.zip"
    assert (archive.stat().st_uid, mode(archive)) == (uid, 0o400)
    assert (data_dir / "objects" / "results" / "job-x").stat().st_uid == uid
    # Other uids may only pass through; the object store's archives are the daemon's.
    assert mode(data_dir) == 0o711 and mode(data_dir / "jobs") == 0o711
    assert mode(data_dir / "objects" / "models") == 0o700
    assert mode(data_dir / "admin.token") == 0o600
    # A new backend (a restarted guardian) gives the job the same uid.
    again = LocalBackend(python=reachable_python(), isolation_config=UIDS)
    assert again.learner_user(spec).uid == uid
    backend.rollback(spec.job_id, spec.job_dir)
    assert not archive.exists() and not secrets.exists()


def test_one_backend_deploys_job_after_job_under_their_uids_on_the_daemons_python(
    data_dir: Path,
) -> None:
    """A guardian host's backend deploys many jobs. Where the daemon's Python is private
    (pyenv under root's 0700 home, as here), the first deploy makes the shim interpreter
    under the data directory (0755): the next deploy's lock-down of the data directory
    must leave it open, or every job after the first failed (strict) or ran as root
    (auto)."""
    private = isolation.unreachable(Path(sys.executable).resolve().parent, LearnerUser(65534, 0))
    backend = LocalBackend(python=sys.executable, isolation_config=UIDS)
    for job_id in ("job-a", "job-b", "job-c"):
        spec = job(data_dir, job_id)
        backend.prepare_volume(spec)
        assert backend.learner_user(spec).uid >= 47000, job_id
    if private is not None:  # the shim is in use, and still open to the learners' uids
        shim = data_dir / isolation.SHIM_DIR
        assert backend.python == str(shim / "bin" / "python")
        assert mode(shim) == 0o755 and mode(shim / "bin") == 0o755


def test_a_data_store_the_job_uid_cannot_read_fails_the_deploy_naming_it(
    data_dir: Path,
) -> None:
    private = Path(tempfile.mkdtemp(prefix="rhizome-private-data-"))
    try:
        store = {"id": "local", "type": "mount_volume", "connection": {"path": str(private)}}
        spec = job(data_dir, data_stores=[store])
        backend = LocalBackend(python=reachable_python(), isolation_config=UIDS)
        with pytest.raises(BackendError, match=f"cannot read {private}.*chmod -R o\\+rX"):
            backend.prepare_volume(spec)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def test_an_unreachable_interpreter_fails_the_deploy_under_a_range_and_under_auto(
    data_dir: Path,
) -> None:
    hidden = Path(tempfile.mkdtemp(prefix="rhizome-hidden-python-"))  # 0700
    try:
        (hidden / "bin").mkdir()
        python = hidden / "bin" / "python"  # only its directory is checked before a start
        python.write_text("#!/bin/sh\n")
        python.chmod(0o755)
        spec = job(data_dir)
        strict = LocalBackend(python=str(python), isolation_config=UIDS)
        with pytest.raises(BackendError, match=f"cannot enter {hidden}.*RHIZOME_LEARNER_PYTHON"):
            strict.prepare_volume(spec)
        # `auto` fails closed too: learners never run as root over an interpreter.
        auto = LocalBackend(python=str(python), isolation_config=IsolationConfig((47000, 47099)))
        with pytest.raises(BackendError, match=f"cannot enter {hidden}.*RHIZOME_LEARNER_PYTHON"):
            auto.learner_user(spec)
    finally:
        shutil.rmtree(hidden, ignore_errors=True)
