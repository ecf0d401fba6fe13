"""Isolation between jobs on the local backend, as root (CI runs as root): each job's
learners run under a uid of their own, and one job's learner cannot read another's code,
checkpoints, secrets or code archive. Real guardians, etcd and MongoDB-wire server."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.backends.local import isolation
from services.backends.local.isolation import LearnerUser
from services.store import states
from tests.services.guardian.helpers import start_guardian, submit, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

# What job A's learner tries; each attempt is reported as read / denied / missing.
PROBE = r"""
import json, os, pathlib
me = pathlib.Path(os.environ["RHIZOME_JOB_DIR"])
other_id = os.environ["OTHER_JOB"]
other = me.parent / other_id
data = me.parent.parent
files = {
    "code": other / "code" / "run.sh",
    "checkpoint": other / "checkpoints" / "ckpt",
    "secrets": other / "secrets" / "env",
    "code_archive_copy": other / "model.zip",
    "object_store_archive": data / "objects" / "models" / f"{other_id}.zip",
    "controller_log": other / "learners" / "0" / "controller.log",
}
listings = {"other_job_dir": other, "jobs_dir": data / "jobs", "data_dir": data}
out = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups()}
def attempt(fn):
    try:
        fn()
        return "read"
    except PermissionError:
        return "denied"
    except FileNotFoundError:
        return "missing"
for name, path in files.items():
    out[name] = attempt(lambda: open(path, "rb").read(1))
for name, path in listings.items():
    out[name] = attempt(lambda: os.listdir(path))
secret = open(os.environ["RHIZOME_SECRETS"]).read()
# Only whose secret it is gets printed (the password ends in the job's letter).
out["own_secret_of"] = secret.startswith("BUCKET_PASSWORD=hunter2-of-") and secret.strip()[-1]
ckpt = pathlib.Path(os.environ["RHIZOME_CHECKPOINT_DIR"]) / "mine"
ckpt.write_text("A")
out["own_checkpoint"] = ckpt.read_text()
print("ISOLATION " + json.dumps(out), flush=True)
"""

HOLD = """echo "B's weights" > "$RHIZOME_CHECKPOINT_DIR/ckpt"
i=0
while [ ! -e "$RELEASE" ] && [ $i -lt 1800 ]; do sleep 0.1; i=$((i+1)); done
"""


@pytest.fixture
def root_data_dir() -> Iterator[Path]:
    """A data directory other uids may traverse (pytest's own are 0700)."""
    with traversable_data_dir("rhizome-isolation-") as path:
        yield path


@contextlib.contextmanager
def traversable_data_dir(prefix: str) -> Iterator[Path]:
    """A data directory for a platform whose learners run under uids of their own: as
    root (only then can the daemon switch users), outside pytest's 0700 directories, with
    the checkout reachable by other uids."""
    if os.geteuid() != 0:
        pytest.fail(
            "the isolation tests need root: the local backend gives each job a uid of its "
            "own only when the daemon can switch users (CI runs as root)"
        )
    blocked = [p for p in [*REPO.parents, REPO] if not os.stat(p).st_mode & stat.S_IXOTH]
    if blocked:
        pytest.fail(f"learner uids cannot enter {blocked[0]} to reach the checkout: chmod o+x it")
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def learner_python() -> Iterator[dict[str, str]]:
    """How the learners get an interpreter they may read. The checkout's own is used when
    other uids can reach it; where it lives in root's private home (a pyenv build under
    /root, as on the team's machines) the system's Python 3.11 runs with the checkout's
    packages (RHIZOME_LEARNER_PYTHON, the operator's way out of the same problem)."""
    nobody = LearnerUser(65534, 65534)
    if isolation.unreachable(Path(sys.executable).resolve().parent, nobody) is None:
        yield {}
        return
    system = Path("/usr/bin/python3.11")
    if not system.exists():
        pytest.fail(
            f"{sys.executable} is under a directory other uids cannot enter and there is no "
            f"{system} to run learners with: install Python where others can read it"
        )
    tools = Path(tempfile.mkdtemp(prefix="rhizome-learner-python-"))
    tools.chmod(0o755)
    site_packages = Path(sysconfig.get_paths()["purelib"])
    (tools / "site").mkdir(mode=0o755)
    (tools / "site" / "sitecustomize.py").write_text(
        f"import site\nsite.addsitedir({str(site_packages)!r})\n"
    )
    (tools / "bin").mkdir(mode=0o755)
    wrapper = tools / "bin" / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={tools / "site"} exec {system} "$@"\n')
    wrapper.chmod(0o755)
    yield {"RHIZOME_LEARNER_PYTHON": str(wrapper)}
    shutil.rmtree(tools, ignore_errors=True)


def guardian(stores: dict[str, Any], data_dir: Path, job_id: str, env: dict[str, str]) -> Any:
    # An explicit range is strict: a learner uid that cannot reach what it needs fails
    # the deploy instead of falling back to root.
    return start_guardian(
        job_id,
        stores["etcd_url"],
        stores["mongo_url"],
        data_dir,
        RHIZOME_LEARNER_UIDS="20000-29999",
        **env,
    )


def explain(stores: dict[str, Any], data_dir: Path, job_id: str) -> str:
    """The job's history and the tails of its guardian's and learner's logs."""
    record = stores["repo"].get(job_id)
    logs = [
        *data_dir.glob(f"guardian-{job_id}-*.log"),
        *data_dir.glob(f"jobs/{job_id}/learners/*/*.log"),
    ]
    tails = "\n".join(f"== {p}\n" + p.read_text(errors="replace")[-2000:] for p in logs)
    return f"{record.status} {[(h.status, h.message) for h in record.history]}\n{tails}"


def store(password: str) -> list[dict[str, Any]]:
    return [{"id": "bucket", "type": "s3_datastore", "connection": {"password": password}}]


def test_a_learner_cannot_read_another_jobs_code_checkpoints_or_secrets(
    stores: dict[str, Any], root_data_dir: Path, learner_python: dict[str, str]
) -> None:
    release = Path(tempfile.mkdtemp(prefix="rhizome-release-"))
    release.chmod(0o755)
    try:
        b = submit(
            stores["repo"],
            root_data_dir,
            "sh run.sh",
            files={"run.sh": HOLD},
            env={"RELEASE": str(release / "go")},
            data_stores=store("hunter2-of-B"),
        )
        b_proc = guardian(stores, root_data_dir, b.job_id, learner_python)
        b_dir = root_data_dir / "jobs" / b.job_id
        wait_for(
            "job B's checkpoint (or its guardian's end)",
            lambda: (b_dir / "checkpoints" / "ckpt").exists() or b_proc.poll() is not None,
            120,
        )
        assert b_proc.poll() is None, explain(stores, root_data_dir, b.job_id)

        # While B runs: its directory is its uid's alone, its secrets 0400.
        b_stat = b_dir.stat()
        assert b_stat.st_uid >= 20000 and stat.S_IMODE(b_stat.st_mode) == 0o700
        secret = (b_dir / "secrets" / "env").stat()
        assert (secret.st_uid, stat.S_IMODE(secret.st_mode)) == (b_stat.st_uid, 0o400)
        assert (b_dir / "secrets" / "env").read_text() == "BUCKET_PASSWORD=hunter2-of-B\n"

        a = submit(
            stores["repo"],
            root_data_dir,
            "python probe.py",
            files={"probe.py": PROBE},
            env={"OTHER_JOB": b.job_id},
            data_stores=store("hunter2-of-A"),
        )
        assert guardian(stores, root_data_dir, a.job_id, learner_python).wait(timeout=180) == 0
        a_dir = root_data_dir / "jobs" / a.job_id
        record = stores["repo"].get(a.job_id)
        out = (a_dir / "learners" / "0" / "stdout.log").read_text()
        assert record.status == states.COMPLETED, explain(stores, root_data_dir, a.job_id)
        report = json.loads(out.split("ISOLATION ", 1)[1].splitlines()[0])

        assert report["uid"] not in (0, b_stat.st_uid) and report["uid"] >= 20000
        # A ended: its uid was released and its files handed to the daemon.
        assert a_dir.stat().st_uid == os.geteuid()
        assert report["groups"] in ([], [report["gid"]])  # none of root's groups
        for what in (
            "code", "checkpoint", "secrets", "code_archive_copy", "object_store_archive",
            "controller_log", "other_job_dir", "jobs_dir", "data_dir",
        ):  # fmt: skip
            assert report[what] == "denied", (what, report)
        assert report["own_secret_of"] == "A"
        assert report["own_checkpoint"] == "A"

        # No learner or guardian log carries either password.
        for log in [
            *root_data_dir.glob("guardian-*.log"),
            *root_data_dir.glob("jobs/*/learners/*/*.log"),
        ]:
            text = log.read_text(errors="replace")
            assert "hunter2" not in text, log

        (release / "go").touch()
        assert b_proc.wait(timeout=120) == 0
        assert stores["repo"].get(b.job_id).status == states.COMPLETED
    finally:
        shutil.rmtree(release, ignore_errors=True)


def test_mnist_completes_under_a_learner_uid(
    stores: dict[str, Any], root_data_dir: Path, learner_python: dict[str, str]
) -> None:
    train = (REPO / "examples" / "mnist" / "train.py").read_text()
    job = submit(
        stores["repo"],
        root_data_dir,
        "python train.py --epochs 2",
        files={"train.py": train},
        memory="2Gb",
    )
    assert guardian(stores, root_data_dir, job.job_id, learner_python).wait(timeout=300) == 0
    job_dir = root_data_dir / "jobs" / job.job_id
    out = (job_dir / "learners" / "0" / "stdout.log").read_text()
    record = stores["repo"].get(job.job_id)
    assert record.status == states.COMPLETED, explain(stores, root_data_dir, job.job_id)
    assert "test_accuracy=" in out
    assert (job_dir / "learners" / "0" / "stdout.log").stat().st_uid == os.geteuid()  # released
    assert isolation.claimed_uid(root_data_dir / "jobs", job.job_id) is None


def test_the_lcm_refuses_a_guardian_log_a_learner_replaced_with_a_link(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    """The job directory is the learner uid's: a link it leaves at guardian.log must not
    make the root LCM append to the file it points at."""
    from services.lcm.manager import LcmConfig, LifecycleManager

    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    job_dir = tmp_path / "jobs" / "job-linked"
    job_dir.mkdir(parents=True)
    (job_dir / "guardian.log").symlink_to(victim)
    config = LcmConfig(tmp_path, stores["etcd_url"], stores["mongo_url"], poll_s=0.1)
    lcm = LifecycleManager(config, stores["repo"], stores["etcd"])
    lcm.spawn("job-linked")
    assert "job-linked" not in lcm.guardians  # no guardian started with that log
    assert victim.read_text() == "root's file\n"
