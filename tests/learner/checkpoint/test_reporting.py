"""Each committed save is reported to the platform as one line on stderr
(contract/checkpoints.py), which the TDS keeps on the job's record."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from contract.checkpoints import CheckpointReport, parse
from contract.env import LearnerEnv
from learner.checkpoint.api import PreemptionNotice
from learner.checkpoint.manager import CheckpointManager


def test_every_committed_save_prints_its_kind_step_and_size_on_stderr(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    env = LearnerEnv(job_id="j", checkpoint_dir=str(tmp_path / "ck"), learner_id="3")
    m = CheckpointManager(env, sources=[])
    before = time.time()
    for step, size in ((5, 1000), (9, 2500)):
        path = m.staging_path(f"model-{step}.bin")
        path.write_bytes(b"x" * size)
        m.backup(path, step=step).result()
    m.close()
    reports = [r for r in map(parse, capfd.readouterr().err.splitlines()) if r is not None]
    assert [(r.kind, r.step, r.size_bytes, r.learner) for r in reports] == [
        ("periodic", 5, 1000, "3"),
        ("periodic", 9, 2500, "3"),
    ]
    assert all(r.time >= before and r.name for r in reports)


def test_an_emergency_save_is_reported_as_one_before_the_learner_would_exit(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    env = LearnerEnv(
        job_id="j",
        checkpoint_dir=str(tmp_path / "ck"),
        insurance="never",
        emergency_exit=False,  # the real one leaves with os._exit right after the report
        save_s=1.0,
        backup_s=1.0,
    )
    m = CheckpointManager(env, sources=[])
    with m.step():
        pass
    now = time.time()
    m._on_notice(PreemptionNotice("sigterm", now, now + 3.0))
    assert m.should_save()
    path = m.staging_path("model.bin")
    path.write_bytes(b"x" * 300)
    m.backup(path)
    m.close()
    reports = [r for r in map(parse, capfd.readouterr().err.splitlines()) if r is not None]
    assert [(r.kind, r.size_bytes) for r in reports] == [("emergency", 300)]


def test_a_line_that_only_looks_like_a_report_is_not_one() -> None:
    good = CheckpointReport("insurance", 7, 10, 1.5, "0", "ckpt-1")
    assert parse(good.line()) == good
    assert parse("echo " + good.line()) is None  # quoted, not at the line's start
    assert parse("rhizome:checkpoint {not json") is None
    assert parse(good.line().replace("insurance", "bogus")) is None
    assert parse(good.line().replace('"size_bytes": 10', '"size_bytes": -1')) is None
