"""The `rhizome` CLI against a real embedded platform (etcd, the MongoDB-wire and
Elasticsearch-API servers and the daemon, started by `rhizome up --embedded` on free
ports and stopped by pid with `rhizome down`): `up` honours explicit ports or says why it
cannot, global options after the command, and `train --wait`'s progress line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from contract.procs import free_port

pytestmark = pytest.mark.integration

RHIZOME = [sys.executable, "-m", "services.client.cli"]
# a user's environment, but the test session's machine-wide uid marks (tests/conftest.py)
KEPT = {"RHIZOME_MACHINE_UID_CLAIMS"}


def user_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RHIZOME_") or k in KEPT}
    return {**env, "COLUMNS": "200"}


def rz(*args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`rhizome ARGS`, the data directory given after the command (a global option)."""
    proc = subprocess.run(
        [*RHIZOME, *args], capture_output=True, text=True, env=user_env(), timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"rhizome {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    data = Path(tmp_path_factory.mktemp("cli-platform"))
    rz("up", "--embedded", "--grpc-port", "0", "--rest-port", "0", "--data-dir", str(data))
    try:
        yield data
    finally:
        rz("down", "--data-dir", str(data), check=False)


def api_port(data: Path) -> int:
    status = json.loads(rz("status", "--json", "--data-dir", str(data)).stdout)
    return int(status["urls"]["api"].rsplit(":", 1)[1])


def test_a_running_platform_keeps_its_port_and_says_how_to_move_it(data_dir: Path) -> None:
    now = api_port(data_dir)
    other = free_port()
    proc = rz(
        "up", "--embedded", "--grpc-port", str(other), "--data-dir", str(data_dir), check=False
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"--grpc-port {other}" in proc.stderr and f"at {now}" in proc.stderr
    assert "rhizome down" in proc.stderr
    assert api_port(data_dir) == now


def test_train_wait_shows_step_loss_and_eta(data_dir: Path, tmp_path: Path) -> None:
    # Steps of 2 s (`--wait` reads the metrics every 2 s) until `--wait` printed an ETA:
    # the test then opens the gate and the rest of the steps come at once (16 s before).
    gate = tmp_path / "go"
    (tmp_path / "train.py").write_text(
        "import os, time\n"
        "for i in range(1, 9):\n"
        "    print(f'step {i}/8 loss={1.0 / i:.4f}', flush=True)\n"
        f"    if not os.path.exists({str(gate)!r}):\n"
        "        time.sleep(2)\n"
    )
    (tmp_path / "manifest.yml").write_text(
        "name: progress\nframework:\n  command: python train.py\n"
        "evaluation_metrics:\n  type: regex_extractor\n  in: stdout\n"
        "  regex: 'step (?P<step>\\d+)/(?P<total_steps>\\d+) loss=(?P<loss>[0-9.]+)'\n"
    )
    proc = subprocess.Popen(
        [*RHIZOME, "train", str(tmp_path / "manifest.yml"), "--wait", "--data-dir", str(data_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=user_env(),
    )
    assert proc.stderr is not None
    stderr = ""
    for line in proc.stderr:  # until `--wait` returns (pytest's timeout bounds it)
        stderr += line
        if "/8, loss" in line and "ETA" in line:
            gate.touch()
    assert proc.wait(timeout=60) == 0, stderr
    assert "COMPLETED" in stderr
    lines = [ln for ln in stderr.splitlines() if "/8, loss" in ln]
    assert lines, f"no progress line in:\n{stderr}"
    assert any("ETA" in ln for ln in lines), f"no ETA in:\n{stderr}"
    assert re.search(r"uploading [0-9.]+ MiB of code \([0-9,]+ bytes\)", stderr)


def test_an_explicit_port_wins_over_the_remembered_one(data_dir: Path) -> None:
    before = api_port(data_dir)
    rz("down", "--data-dir", str(data_dir))
    wanted = free_port()
    assert wanted != before
    rz("up", "--embedded", "--data-dir", str(data_dir), "--grpc-port", str(wanted))
    assert api_port(data_dir) == wanted
    assert json.loads(rz("version", "--json", "--data-dir", str(data_dir)).stdout)["server"]
    rz("down", "--data-dir", str(data_dir))
    rz("up", "--embedded", "--data-dir", str(data_dir))  # no port given: the remembered one
    assert api_port(data_dir) == wanted
