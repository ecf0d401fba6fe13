"""examples/mnist checkpoints through the SDK every epoch: a run stopped after some
epochs and started again with the same checkpoint directory continues from the last
finished epoch, and ends with the same model as an unbroken run (each epoch's shuffle is
drawn from (seed, epoch))."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "mnist" / "train.py"


def run(ckpt: Path, result: Path, epochs: int) -> str:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("RHIZOME_")},
        "RHIZOME_JOB_ID": "mnist-test",
        "RHIZOME_CHECKPOINT_DIR": str(ckpt),
        "RHIZOME_RESULT_DIR": str(result),
    }
    proc = subprocess.run(
        [sys.executable, str(TRAIN), "--epochs", str(epochs)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=TRAIN.parent,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def epochs_run(out: str) -> list[int]:
    return [int(m) for m in re.findall(r"^epoch (\d+)/", out, re.MULTILINE)]


def test_a_second_run_continues_from_the_last_epoch_and_matches_an_unbroken_one(
    tmp_path: Path,
) -> None:
    first = run(tmp_path / "ckpt", tmp_path / "r1", epochs=1)
    assert epochs_run(first) == [1] and "resuming" not in first
    second = run(tmp_path / "ckpt", tmp_path / "r2", epochs=2)
    assert "resuming from the checkpoint of epoch 1/2" in second
    assert epochs_run(second) == [2]
    unbroken = run(tmp_path / "ckpt-unbroken", tmp_path / "r3", epochs=2)
    assert epochs_run(unbroken) == [1, 2]
    final = re.compile(r"final test accuracy: (\S+)")
    resumed_acc = final.search(second)
    unbroken_acc = final.search(unbroken)
    assert resumed_acc and unbroken_acc and resumed_acc.group(1) == unbroken_acc.group(1)
