"""The manager's decisions and save kinds, in-process, with a local store and no sources."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from contract.env import LearnerEnv
from contract.status import ExitCode
from learner.checkpoint.api import (
    CheckpointKind,
    NoticeCallback,
    PreemptionNotice,
    PreemptionNoticeSource,
)
from learner.checkpoint.manager import CheckpointManager


class SilentSigterm(PreemptionNoticeSource):
    """Stands in for the SIGTERM source (its grace counts) without touching signals."""

    name = "sigterm"

    def start(self, callback: NoticeCallback) -> None:
        return None

    def stop(self) -> None:
        return None


def _manager(
    tmp_path: Path, sources: list[PreemptionNoticeSource] | None = None, **kw: object
) -> CheckpointManager:
    env = LearnerEnv(job_id="j", checkpoint_dir=str(tmp_path / "ck"), **kw)  # type: ignore[arg-type]
    return CheckpointManager(env, sources=sources or [])


def record_exits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The manager's `os._exit` codes, recorded; each call raises SystemExit instead."""
    exits: list[int] = []

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr("learner.checkpoint.manager.os._exit", fake_exit)
    return exits


def _save(m: CheckpointManager, text: str) -> Path:
    p = m.staging_path("model.pt")
    p.write_text(text)
    return p


def test_emergency_save_on_notice_is_committed_before_backup_returns(tmp_path: Path) -> None:
    m = _manager(tmp_path, insurance="never", emergency_exit=False, save_s=1.0, backup_s=1.0)
    with m.step():
        pass
    m._step_times.append(1.0)  # a 1 s step, so the timing below is exact
    assert not m.should_save()
    now = time.time()
    m._on_notice(PreemptionNotice("sigterm", now, now + 100.0))
    assert m.preempted()
    # 1 + 2 * (1 + 1 + 1) = 7 s < 100 s left: train on
    assert not m.should_save()
    assert m.last_decision is not None and m.last_decision.reason == "emergency-deferred"
    m._on_notice(PreemptionNotice("sigterm", now, now + 3.0))
    # 7 s no longer fit, save + backup (2 s) do: save now
    assert m.should_save()
    future = m.backup(_save(m, "state@1"))
    assert future.done()
    committed = future.result()
    assert committed.kind is CheckpointKind.EMERGENCY and committed.step == 1
    assert not m.should_save()  # one emergency save per notice
    m.close()


def test_emergency_save_exits_with_the_preempted_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = _manager(tmp_path, insurance="never", save_s=1.0, backup_s=1.0)
    m._step_times.append(1.0)
    now = time.time()
    m._on_notice(PreemptionNotice("sigterm", now, now + 3.9))
    assert m.should_save()
    exits = record_exits(monkeypatch)
    with pytest.raises(SystemExit):
        m.backup(_save(m, "x"))
    assert exits == [ExitCode.PREEMPTED]
    latest = m.latest_checkpoint()
    assert latest is not None and latest.kind is CheckpointKind.EMERGENCY


def test_a_backup_after_a_notice_from_a_script_that_never_asks_is_the_emergency_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script that saves every epoch and never calls should_save() (examples/mnist):
    its first save after the notice holds every step done, so it is the emergency one and
    the learner leaves, instead of training on until the grace ends and it is killed."""
    m = _manager(tmp_path, insurance="never", save_s=1.0, backup_s=1.0)
    with m.step():
        pass
    m.backup(_save(m, "epoch 1")).result()
    now = time.time()
    m._on_notice(PreemptionNotice("sigterm", now, now + 100.0))  # plenty of time left
    with m.step():
        pass
    exits = record_exits(monkeypatch)
    with pytest.raises(SystemExit):
        m.backup(_save(m, "epoch 2"))
    assert exits == [ExitCode.PREEMPTED]
    latest = m.latest_checkpoint()
    assert latest is not None and latest.kind is CheckpointKind.EMERGENCY and latest.step == 2


def test_a_script_that_asks_keeps_its_own_saves_periodic_while_told_to_train_on(
    tmp_path: Path,
) -> None:
    m = _manager(tmp_path, insurance="never", emergency_exit=False, save_s=1.0, backup_s=1.0)
    with m.step():
        pass
    m._step_times.append(1.0)
    now = time.time()
    m._on_notice(PreemptionNotice("sigterm", now, now + 100.0))
    assert not m.should_save()  # emergency-deferred: train on
    periodic = m.backup(_save(m, "own schedule")).result()
    assert periodic.kind is CheckpointKind.PERIODIC
    m.close()


def test_policy_none_keeps_an_unasked_save_after_a_notice_periodic(tmp_path: Path) -> None:
    m = _manager(tmp_path, checkpoint_policy="none", emergency_exit=False)
    now = time.time()
    m._on_notice(PreemptionNotice("sigterm", now, now + 100.0))
    with m.step():
        pass
    assert m.backup(_save(m, "mine")).result().kind is CheckpointKind.PERIODIC
    m.close()


def test_notice_with_no_time_left_falls_back_to_insurance(tmp_path: Path) -> None:
    # save_s = 0 makes the Daly interval 0, so insurance is due at every boundary.
    m = _manager(tmp_path, insurance="auto", save_s=0.0, backup_s=0.0, grace_s=0.0)
    now = time.time()
    m._on_notice(PreemptionNotice("sigterm", now - 1, now))
    with m.step():
        pass
    assert m.should_save()
    assert m.last_decision is not None and m.last_decision.reason == "insurance"
    got = m.backup(_save(m, "i")).result()
    assert got.kind is CheckpointKind.INSURANCE
    m.close()


def test_auto_mode_takes_no_insurance_when_an_emergency_save_fits(tmp_path: Path) -> None:
    m = _manager(
        tmp_path, [SilentSigterm()], insurance="auto", save_s=0.0, backup_s=0.0, grace_s=30.0
    )
    with m.step():
        pass
    assert not m.should_save()
    assert m.last_decision is not None and m.last_decision.reason == "no-insurance"
    m.close()


def test_without_notice_sources_insurance_is_needed_in_auto_mode(tmp_path: Path) -> None:
    m = _manager(tmp_path, [], insurance="auto", save_s=0.0, backup_s=0.0, grace_s=30.0)
    with m.step():
        pass
    assert m.should_save()
    m.close()


def test_unprompted_backups_are_periodic_and_gc_drops_older_insurance(tmp_path: Path) -> None:
    m = _manager(tmp_path, insurance="always", save_s=0.0, backup_s=0.0, keep=0)
    with m.step():
        pass
    assert m.should_save()
    m.backup(_save(m, "ins")).result()
    with m.step():
        pass
    periodic = m.backup(_save(m, "per")).result()
    assert periodic.kind is CheckpointKind.PERIODIC and periodic.step == 2
    assert [c.name for c in m.store.list_committed()] == [periodic.name]
    # staged sources are removed once committed
    assert list(m.staging.iterdir()) == []
    m.close()


def test_a_new_manager_resumes_the_step_count_from_the_latest_checkpoint(tmp_path: Path) -> None:
    m = _manager(tmp_path)
    for _ in range(3):
        with m.step():
            pass
    m.backup(_save(m, "s3")).result()
    m.close()
    again = _manager(tmp_path)
    assert again.steps_done == 3
    latest = again.latest_checkpoint()
    assert latest is not None and latest.path.read_text() == "s3"
    again.close()


def test_save_time_is_measured_from_step_end_to_backup(tmp_path: Path) -> None:
    m = _manager(tmp_path, save_s=1234.0)
    with m.step():
        pass
    m.backup(_save(m, "x")).result()
    assert m.save_s < 1234.0  # replaced by the measurement
    m.close()


def test_policy_none_takes_no_save_of_its_own_even_on_a_notice(tmp_path: Path) -> None:
    m = _manager(tmp_path, checkpoint_policy="none", save_s=0.0, backup_s=0.0)
    with m.step():
        pass
    assert not m.should_save()  # insurance would be due at every boundary otherwise
    now = time.time()
    m._on_notice(PreemptionNotice("sigterm", now, now + 5.0))
    assert not m.should_save()
    assert m.last_decision is not None and m.last_decision.reason == "policy-none"
    m.close()


def test_policy_fixed_saves_every_interval_whatever_daly_says(tmp_path: Path) -> None:
    # With a notice source whose grace fits an emergency save, adaptive takes no insurance;
    # fixed saves on its own clock anyway.
    m = _manager(
        tmp_path,
        [SilentSigterm()],
        checkpoint_policy="fixed",
        checkpoint_interval_s=0.05,
        save_s=0.0,
        backup_s=0.0,
        grace_s=30.0,
        mttp_s=1e9,  # Daly's interval would be huge
    )
    assert m.interval_s() == 0.05
    with m.step():
        pass
    m._last_save_point = time.monotonic() - 0.1
    assert m.should_save()
    assert m.last_decision is not None and m.last_decision.reason == "insurance"
    m._last_save_point = time.monotonic()
    assert not m.should_save()
    assert m.last_decision is not None and m.last_decision.reason == "not-due"
    m.close()


def test_policy_adaptive_takes_the_manifest_interval_as_the_scripts_own_period(
    tmp_path: Path,
) -> None:
    m = _manager(tmp_path, checkpoint_interval_s=120.0)
    assert m.env.periodic_every_s is None
    m._periodic_points.append(time.monotonic() - 100.0)
    assert m._next_periodic_in(time.monotonic()) == pytest.approx(20.0, abs=1.0)
    m.close()
