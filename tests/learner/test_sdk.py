"""The SDK picks the real manager on the platform and its dummy twin anywhere else."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import learner.sdk as rz
from learner.checkpoint.api import CheckpointKind
from learner.checkpoint.manager import CheckpointManager, DummyContext

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh_context() -> Iterator[None]:
    rz.close()
    yield
    rz.close()


def test_bare_environment_gives_the_dummy_twin(tmp_path: Path) -> None:
    ctx = rz.init({})
    assert isinstance(ctx, DummyContext)
    with rz.step():
        pass
    assert rz.should_save() is False
    assert rz.preempted() is False
    assert rz.latest_checkpoint() is None
    assert rz.backup(tmp_path / "anything").cancelled()
    assert rz.wait_backups() == []


def test_platform_environment_gives_the_manager(tmp_path: Path) -> None:
    ctx = rz.init(
        {
            "RHIZOME_JOB_ID": "j",
            "RHIZOME_CHECKPOINT_DIR": str(tmp_path),
            "RHIZOME_NOTICE_SOURCES": "sigterm",
        }
    )
    assert isinstance(ctx, CheckpointManager)
    with rz.step():
        pass
    path = rz.staging_path("m.pt")
    path.write_text("weights")
    committed = rz.backup(path).result()
    assert committed.kind is CheckpointKind.PERIODIC and committed.step == 1
    latest = rz.latest_checkpoint()
    assert latest is not None and latest.path.read_text() == "weights"


def test_example_script_runs_bare(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RHIZOME_")}
    progress = tmp_path / "p.jsonl"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "examples/spot-checkpoint/train.py"),
            "--steps",
            "5",
            "--save-every",
            "2",
            "--progress",
            str(progress),
        ],
        env=env,
        check=True,
        cwd=tmp_path,
    )
    lines = progress.read_text().splitlines()
    assert '"step": 5' in lines[-2] and '"done"' in lines[-1]
    assert not (tmp_path / ".rhizome").exists()  # bare: nothing backed up
