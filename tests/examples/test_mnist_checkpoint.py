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


def start(ckpt: Path, result: Path, epochs: int) -> subprocess.Popen[str]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("RHIZOME_")},
        "RHIZOME_JOB_ID": "mnist-test",
        "RHIZOME_CHECKPOINT_DIR": str(ckpt),
        "RHIZOME_RESULT_DIR": str(result),
    }
    return subprocess.Popen(
        [sys.executable, str(TRAIN), "--epochs", str(epochs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=TRAIN.parent,
    )


def finish(proc: subprocess.Popen[str]) -> str:
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    return out


def run(ckpt: Path, result: Path, epochs: int) -> str:
    return finish(start(ckpt, result, epochs))


def epochs_run(out: str) -> list[int]:
    return [int(m) for m in re.findall(r"^epoch (\d+)/", out, re.MULTILINE)]


def test_a_second_run_continues_from_the_last_epoch_and_matches_an_unbroken_one(
    tmp_path: Path,
) -> None:
    # The unbroken run shares nothing with the other two (its own checkpoint directory),
    # so it trains beside them: each is one torch thread (train.py), and the result is
    # the same whatever runs next to it.
    unbroken_proc = start(tmp_path / "ckpt-unbroken", tmp_path / "r3", epochs=2)
    try:
        first = run(tmp_path / "ckpt", tmp_path / "r1", epochs=1)
        assert epochs_run(first) == [1] and "resuming" not in first
        second = run(tmp_path / "ckpt", tmp_path / "r2", epochs=2)
        assert "resuming from the checkpoint of epoch 1/2" in second
        assert epochs_run(second) == [2]
    except BaseException:
        unbroken_proc.kill()
        unbroken_proc.wait()
        raise
    unbroken = finish(unbroken_proc)
    assert epochs_run(unbroken) == [1, 2]
    final = re.compile(r"final test accuracy: (\S+)")
    resumed_acc = final.search(second)
    unbroken_acc = final.search(unbroken)
    assert resumed_acc and unbroken_acc and resumed_acc.group(1) == unbroken_acc.group(1)
