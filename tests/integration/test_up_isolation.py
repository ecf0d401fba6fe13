"""`rhizome up` with its default learner isolation (`auto`, as root: CI runs as root):
job after job trained on one platform runs under a uid of its own and completes. The
rest of the suite runs learners as the test's user (tests/conftest.py), so this is the
one end-to-end check of the default. Where the daemon's Python is private (pyenv under
root's home, as here) the learners run the shim interpreter under the data directory;
every job after a guardian host's first once failed its deploy on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_isolation import root_data_dir  # noqa: F401 - fixture

pytestmark = pytest.mark.integration

RHIZOME = [sys.executable, "-m", "services.client.cli"]
PROBE = 'import json, os\nprint("WHOAMI " + json.dumps({"uid": os.getuid()}), flush=True)\n'


def run(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RHIZOME_LEARNER_UIDS", "RHIZOME_TOKEN")
    }
    proc = subprocess.run(
        [*RHIZOME, "--data-dir", str(data_dir), *args],
        capture_output=True,
        text=True,
        env=env,  # the platform's default isolation: no RHIZOME_LEARNER_UIDS
        timeout=120,
    )
    assert proc.returncode == 0, f"rhizome {' '.join(args)}: {proc.stderr}"
    return proc


def rz(data_dir: Path, *args: str) -> str:
    return run(data_dir, *args).stdout


def test_jobs_after_the_first_run_under_their_own_uid_and_complete(
    root_data_dir: Path,  # noqa: F811 - the imported fixture
    tmp_path: Path,
) -> None:
    data_dir = root_data_dir  # others may traverse it (pytest's own directories are 0700)
    code = tmp_path / "code"
    code.mkdir()
    (code / "probe.py").write_text(PROBE)
    (code / "manifest.yml").write_text("name: whoami\nframework:\n  command: python probe.py\n")
    up = run(data_dir, "up", "--embedded", "--grpc-port", "0", "--rest-port", "0")
    assert "not isolated" not in up.stderr  # the uids can reach this data directory
    try:
        uids = []
        for _ in range(3):
            job_id = json.loads(
                rz(data_dir, "--json", "train", str(code / "manifest.yml"), str(code))
            )["job_id"]
            deadline = time.monotonic() + 90
            status = ""
            while time.monotonic() < deadline:
                status = json.loads(rz(data_dir, "--json", "show", job_id))["status"]
                if status in ("COMPLETED", "FAILED"):
                    break
                time.sleep(0.3)
            shown = rz(data_dir, "show", job_id)
            assert status == "COMPLETED", shown
            logs = rz(data_dir, "logs", job_id)
            line = next(ln for ln in logs.splitlines() if "WHOAMI " in ln)
            uids.append(json.loads(line.split("WHOAMI ", 1)[1])["uid"])
        assert all(uid >= 20000 for uid in uids), uids  # never the daemon's own (root)
    finally:
        subprocess.run(
            [*RHIZOME, "--data-dir", str(data_dir), "down"], capture_output=True, timeout=120
        )
