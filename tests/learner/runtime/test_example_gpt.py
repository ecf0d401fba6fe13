"""examples/pipeline-gpt trains through the launcher and survives a stage's SIGKILL."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.embedded.process import ManagedServer

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.integration
def test_pipeline_gpt_survives_sigkill_of_a_stage(etcd_server: ManagedServer) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "learner.runtime.launch",
            "--stages",
            "2",
            "--etcd",
            etcd_server.url,
            "--detection-timeout",
            "10",
            "--kill",
            "1:3:forward:1",
            str(REPO / "examples" / "pipeline-gpt" / "train.py"),
            "--steps",
            "6",
            "--layers",
            "2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "worker 1 killed by signal 9" in proc.stderr
    losses = {
        int(m.group(1)): (float(m.group(2)), int(m.group(3)))
        for m in re.finditer(r"step (\d+) loss ([\d.]+) generation (\d+)", proc.stdout)
    }
    assert sorted(losses) == list(range(6))
    assert losses[5][1] == 1  # finished on the failed-over configuration
    assert losses[5][0] < losses[0][0]  # and still learning
