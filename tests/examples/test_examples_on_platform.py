"""The examples run through `rhizome train` on a real embedded platform (etcd, the
MongoDB-wire and Elasticsearch-API servers and the daemon, started by `rhizome up
--embedded` on free ports and stopped by pid with `rhizome down`), with the commands
their READMEs give; examples/mnist halted after an epoch and resumed continues from its
checkpoint instead of starting over."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RHIZOME = [sys.executable, "-m", "services.client.cli"]
# a user's environment, but the test session's machine-wide uid marks (tests/conftest.py)
KEPT = {"RHIZOME_MACHINE_UID_CLAIMS"}


def rz(data: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RHIZOME_") or k in KEPT}
    proc = subprocess.run(
        [*RHIZOME, "--data-dir", str(data), *args],
        capture_output=True,
        text=True,
        env={**env, "COLUMNS": "200"},
        timeout=timeout,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"rhizome {' '.join(args)} exited {proc.returncode}: {proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    data = Path(tmp_path_factory.mktemp("examples"))
    rz(data, "up", "--embedded", "--grpc-port", "0", "--rest-port", "0")
    try:
        yield data
    finally:
        subprocess.run([*RHIZOME, "--data-dir", str(data), "down"], capture_output=True)


def log_text(data: Path, job_id: str) -> str:
    return "\n".join(
        json.loads(line)["line"]
        for line in rz(data, "logs", job_id, "--json").stdout.splitlines()
        if line.strip()
    )


def test_spot_checkpoint_runs_through_rhizome_train(platform: Path) -> None:
    proc = rz(platform, "train", "examples/spot-checkpoint/manifest.yml", "--wait")
    assert "COMPLETED" in proc.stderr, proc.stderr


MNIST_EPOCHS = 30
EPOCH_LOOP = "    for epoch in range(done + 1, args.epochs + 1):\n"


def test_mnist_halted_and_resumed_continues_from_its_checkpoint(
    platform: Path, tmp_path: Path
) -> None:
    # 30 epochs instead of the example's 10, as `make demo` does: an epoch takes well
    # under a second on a fast machine, and 10 of them could all end between the poll
    # that sees epoch 2 and the halt (CI saw the job COMPLETED before the halt landed).
    example = tmp_path / "mnist"
    shutil.copytree(ROOT / "examples" / "mnist", example)
    manifest = example / "manifest.yml"
    text = manifest.read_text()
    assert "--epochs 10" in text, "examples/mnist/manifest.yml changed its command"
    manifest.write_text(text.replace("--epochs 10", f"--epochs {MNIST_EPOCHS}"))
    # Each epoch (~0.1 s) waits 1 s first until the test opens a gate, so the halt lands
    # while it trains; the gate opens once it is HALTED, and the resumed run trains its
    # remaining epochs at full speed (batches of 8 paced both runs: ~20 s).
    gate = tmp_path / "go"
    train = example / "train.py"
    code = train.read_text()
    assert EPOCH_LOOP in code, "examples/mnist/train.py changed its epoch loop"
    train.write_text(
        code.replace(
            EPOCH_LOOP,
            f"{EPOCH_LOOP}        if not os.path.exists({str(gate)!r}):\n"
            "            time.sleep(1.0)  # the test's pace until it halted the job\n",
        )
    )
    job_id = json.loads(rz(platform, "train", str(manifest), "--json").stdout)["job_id"]
    deadline = time.monotonic() + 240
    second = re.compile(rf"^epoch ([2-9]|[1-9]\d)/{MNIST_EPOCHS}", re.MULTILINE)
    while not second.search(log_text(platform, job_id)):
        assert time.monotonic() < deadline, "examples/mnist logged no second epoch in 240 s"
        time.sleep(0.5)  # each look is a CLI call too (~0.5 s)
    assert json.loads(rz(platform, "halt", job_id, "--json").stdout)["status"] == "HALTED"
    gate.touch()
    before = [
        int(e)
        for e in re.findall(rf"^epoch (\d+)/{MNIST_EPOCHS}", log_text(platform, job_id), re.M)
    ]
    rz(platform, "resume", job_id)
    rz(platform, "show", job_id)
    status = ""
    while status not in ("COMPLETED", "FAILED", "DELETED", "HALTED"):
        assert time.monotonic() < deadline + 240, f"the resumed job is still {status}"
        time.sleep(0.5)
        status = json.loads(rz(platform, "show", job_id, "--json").stdout)["status"]
    assert status == "COMPLETED"
    text = log_text(platform, job_id)
    resumed = re.search(rf"resuming from the checkpoint of epoch (\d+)/{MNIST_EPOCHS}", text)
    assert resumed, f"the resumed learner started over:\n{text[-2000:]}"
    assert int(resumed.group(1)) >= max(before) - 1 >= 1  # at most the epoch under way is redone
    assert "final test accuracy" in text
