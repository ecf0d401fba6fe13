"""Learner uid claims are released (local backend, as root; CI runs as root): a job that
ends gives its uid back with its files handed to the daemon, the next job gets the same
uid and cannot read the first one's files, and a claim left by a job that ended without
releasing it (a guardian that died) is released by the next guardian to start. Real
guardians, etcd and MongoDB-wire server."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from services.backends.local import isolation
from services.store import states
from tests.integration.test_isolation import (  # noqa: F401 - fixtures
    explain,
    guardian,
    learner_python,
    root_data_dir,
)
from tests.services.guardian.helpers import submit

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
print("UIDPROBE " + json.dumps({"uid": os.getuid(), "other": seen}), flush=True)
"""


def run_probe(
    stores: dict[str, Any], data_dir: Path, env: dict[str, str], other: str = ""
) -> tuple[str, dict[str, Any]]:
    job = submit(
        stores["repo"],
        data_dir,
        "python probe.py",
        files={"probe.py": PROBE},
        env={"OTHER_JOB": other} if other else {},
    )
    assert guardian(stores, data_dir, job.job_id, env).wait(timeout=180) == 0
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
    assert seen_b == {"uid": FIRST_UID, "other": "denied"}
    assert isolation.claimed_uid(jobs, b) is None
