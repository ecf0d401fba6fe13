"""Learner uid claims are released (local backend, as root; CI runs as root): a job that
ends gives its uid back with its files handed to the daemon, the next job gets the same
uid and cannot read the first one's files, and a claim left by a job that ended without
releasing it (a guardian that died) is released by the next guardian to start. Real
guardians, etcd and MongoDB-wire server."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from services.backends.local import isolation
from services.backends.local.isolation import LearnerUser
from services.store import states
from tests.integration.test_isolation import (  # noqa: F401 - fixtures
    explain,
    learner_python,
    root_data_dir,
)
from tests.services.guardian.helpers import start_guardian, submit

pytestmark = pytest.mark.integration

FIRST_UID = 20000  # the lowest of the range test_isolation's guardians use

# Who the learner runs as, and what it can see of the other job's files.
PROBE = r"""
import json, os, pathlib
me = pathlib.Path(os.environ["RHIZOME_JOB_DIR"])
(pathlib.Path(os.environ["RHIZOME_CHECKPOINT_DIR"]) / "weights").write_text("mine")
other = os.environ.get("OTHER_JOB")
seen = "none"
if other:
    try:
        (me.parent / other / "checkpoints" / "weights").read_text()
        seen = "read"
    except PermissionError:
        seen = "denied"
import sys
out = {"uid": os.getuid(), "other": seen, "python": sys.executable}
print("UIDPROBE " + json.dumps(out), flush=True)
"""


def run_probe(
    stores: dict[str, Any],
    data_dir: Path,
    env: dict[str, str],
    other: str = "",
    uids: str = "20000-29999",
) -> tuple[str, dict[str, Any]]:
    job = submit(
        stores["repo"],
        data_dir,
        "python probe.py",
        files={"probe.py": PROBE},
        env={"OTHER_JOB": other} if other else {},
    )
    proc = start_guardian(
        job.job_id,
        stores["etcd_url"],
        stores["mongo_url"],
        data_dir,
        RHIZOME_LEARNER_UIDS=uids,
        **env,
    )
    assert proc.wait(timeout=180) == 0, explain(stores, data_dir, job.job_id)
    assert stores["repo"].get(job.job_id).status == states.COMPLETED, explain(
        stores, data_dir, job.job_id
    )
    out = (data_dir / "jobs" / job.job_id / "learners" / "0" / "stdout.log").read_text()
    return job.job_id, json.loads(out.split("UIDPROBE ", 1)[1].splitlines()[0])


def test_a_uid_is_released_at_job_end_and_stale_claims_at_guardian_start(
    stores: dict[str, Any],
    root_data_dir: Path,  # noqa: F811 - the imported fixture
    learner_python: dict[str, str],  # noqa: F811
) -> None:
    jobs = root_data_dir / "jobs"
    # A claim of a job that ended without releasing it: no record, files of its uid left.
    ghost = jobs / "job-ghost-gone"
    (ghost / "checkpoints").mkdir(parents=True)
    (ghost / "checkpoints" / "weights").write_text("ghost's")
    for path in (ghost, ghost / "checkpoints", ghost / "checkpoints" / "weights"):
        os.chown(path, FIRST_UID, FIRST_UID)
    (jobs / isolation.CLAIMS_DIR).mkdir(mode=0o700)
    (jobs / isolation.CLAIMS_DIR / str(FIRST_UID)).write_text("job-ghost-gone")

    a, seen_a = run_probe(stores, root_data_dir, learner_python)
    # The guardian released the ghost's claim first (its files are now the daemon's),
    # so A got the lowest uid again.
    assert isolation.claimed_uid(jobs, "job-ghost-gone") is None
    assert (ghost / "checkpoints" / "weights").stat().st_uid == os.geteuid()
    assert seen_a["uid"] == FIRST_UID
    # A ended: its claim is gone and nothing under its trees is its uid's any more.
    assert isolation.claimed_uid(jobs, a) is None
    leftovers = [
        p
        for tree in (jobs / a, root_data_dir / "objects" / "results" / a)
        for p in [tree, *tree.rglob("*")]
        if p.exists() and p.lstat().st_uid == FIRST_UID
    ]
    assert leftovers == []

    # B reuses the uid and still cannot read A's checkpoint.
    b, seen_b = run_probe(stores, root_data_dir, learner_python, other=a)
    assert (seen_b["uid"], seen_b["other"]) == (FIRST_UID, "denied")
    assert isolation.claimed_uid(jobs, b) is None


def test_auto_runs_learners_under_their_uid_even_where_the_daemons_python_is_private(
    stores: dict[str, Any],
    root_data_dir: Path,  # noqa: F811 - the imported fixture
) -> None:
    """The daemon's interpreter here may live in root's 0700 home (pyenv): `auto` used to
    run such learners as root; now they run under their uid, on the system's Python of
    the same version with the daemon's packages (no RHIZOME_LEARNER_PYTHON given)."""
    private = isolation.unreachable(
        Path(sys.executable).resolve().parent, LearnerUser(65534, 65534)
    )
    _, seen = run_probe(stores, root_data_dir, {"RHIZOME_LEARNER_PYTHON": ""}, uids="auto")
    assert seen["uid"] >= FIRST_UID
    if private is not None:
        assert seen["python"] == str(
            Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}").resolve()
        )
        shim = root_data_dir / "learner-python" / "bin" / "python"
        assert stat.S_IMODE(shim.stat().st_mode) == 0o755 and shim.stat().st_uid == os.geteuid()
