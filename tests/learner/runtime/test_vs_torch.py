"""Every runtime mode trains exactly as torch.distributed.pipelining does (issue #24).

The benchmark's own harness on the tests' float64 MLP: two worker processes through the
launcher, a real etcd started (and stopped by pid) by the script, torch's Schedule1F1B
and ScheduleGPipe and the runtime's modes in the same processes, from the same seed on
the same microbatches. Only the per-step losses and the ``--json`` shape are checked here,
never the timings.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]


def test_per_step_losses_of_every_mode_equal_torch_pipelining() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "runtime_vs_torch.py"),
            "--model",
            "tiny",
            "--steps",
            "5",
            "--reps",
            "1",
            "--idle-s",
            "0.5",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    modes = got["modes"]
    assert set(modes) == {
        "torch-1f1b",
        "torch-gpipe",
        "rz-none",
        "rz-lazy-frc-lazy-brc",
        "rz-eager-frc-lazy-brc",
    }
    for mode, row in modes.items():
        assert row["max_loss_diff"] is not None, f"{mode}: no losses compared"
        assert row["max_loss_diff"] <= 1e-4, f"{mode}: losses differ by {row['max_loss_diff']}"
        assert row["iter_ms"] > 0
        # etcd's CPU in steady training beside the earlier figure (issue #24's goal): a
        # window that leaves the run's start-up and finish out, and etcd's idle floor
        assert row["etcd_steady_window_s"] > 0, f"{mode}: no steady window"
        assert 0 <= row["etcd_steady_cpu_cores"] < 2, mode
        assert row["etcd_cpu_cores"] >= 0, mode
    assert got["losses_match"] is True
    assert got["steady_from_step"] >= 3
    assert set(got["etcd_idle_windows"]) == {"before", "after"}
    assert all(w["window_s"] >= 0.5 for w in got["etcd_idle_windows"].values())
    assert got["etcd_idle_cpu_cores"] is not None and got["etcd_idle_cpu_cores"] >= 0
