"""The Daly optimum and the emergency-save condition against hand-computed values."""

from __future__ import annotations

import math

import pytest

from learner.checkpoint.policy import daly_interval, emergency_save_fits, insurance_decision


def test_daly_interval_matches_hand_computed_values() -> None:
    # sqrt(2 * 1 * (49 + 1)) = sqrt(100) = 10
    assert daly_interval(1.0, 49.0, 1.0) == pytest.approx(10.0)
    # GPT-117M-like: δ = 60 s, MTTP = 3 h, R = 300 s: sqrt(2*60*11100) = sqrt(1,332,000)
    assert daly_interval(60.0, 10800.0, 300.0) == pytest.approx(1154.1230437, rel=1e-9)
    # δ = 8 s, MTTP = 1 h, R = 0: sqrt(57600) = 240
    assert daly_interval(8.0, 3600.0, 0.0) == pytest.approx(240.0)


def test_daly_interval_grows_with_the_square_root_of_save_time() -> None:
    assert daly_interval(4.0, 100.0, 0.0) / daly_interval(1.0, 100.0, 0.0) == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("save", "mttp", "restart"), [(-1.0, 10.0, 0.0), (1.0, 0.0, 0.0), (1.0, 10.0, -1.0)]
)
def test_daly_interval_rejects_bad_input(save: float, mttp: float, restart: float) -> None:
    with pytest.raises(ValueError, match="daly_interval needs"):
        daly_interval(save, mttp, restart)


def test_emergency_save_condition() -> None:
    # AWS: 120 s notice; step 2 s, save 30 s, backup 60 s -> 92 < 120
    assert emergency_save_fits(2.0, 30.0, 60.0, 120.0)
    # GCP: 30 s notice, same job -> 92 >= 30
    assert not emergency_save_fits(2.0, 30.0, 60.0, 30.0)
    # strict inequality: exactly the grace does not fit
    assert not emergency_save_fits(10.0, 10.0, 10.0, 30.0)
    assert emergency_save_fits(10.0, 10.0, 9.999, 30.0)


def test_insurance_is_off_when_an_emergency_save_fits_in_auto_mode() -> None:
    d = insurance_decision(
        since_last_save_s=1e6, step_s=1, save_s=1, backup_s=1, mttp_s=49, restart_s=1, grace_s=30
    )
    assert (d.save, d.reason) == (False, "no-insurance")
    assert d.interval_s == pytest.approx(10.0)


def test_insurance_is_due_after_one_daly_interval() -> None:
    common = dict(step_s=1.0, save_s=1.0, backup_s=1.0, mttp_s=49.0, restart_s=1.0, grace_s=2.0)
    assert insurance_decision(since_last_save_s=9.9, **common).reason == "not-due"  # type: ignore[arg-type]
    assert insurance_decision(since_last_save_s=10.0, **common).save  # type: ignore[arg-type]


def test_insurance_is_skipped_when_the_periodic_save_comes_within_a_step() -> None:
    common = dict(
        since_last_save_s=11.0, step_s=1.0, save_s=1.0, backup_s=1.0, mttp_s=49.0, restart_s=1.0
    )
    soon = insurance_decision(grace_s=0.0, next_periodic_in_s=0.5, **common)  # type: ignore[arg-type]
    assert (soon.save, soon.reason) == (False, "periodic-soon")
    later = insurance_decision(grace_s=0.0, next_periodic_in_s=5.0, **common)  # type: ignore[arg-type]
    assert later.save


def test_insurance_modes_always_and_never() -> None:
    common = dict(
        since_last_save_s=100.0, step_s=1.0, save_s=1.0, backup_s=1.0, mttp_s=49, restart_s=1
    )
    assert insurance_decision(grace_s=120.0, mode="always", **common).save  # type: ignore[arg-type]
    assert not insurance_decision(grace_s=0.0, mode="never", **common).save  # type: ignore[arg-type]
    assert math.isfinite(insurance_decision(grace_s=0.0, **common).interval_s)  # type: ignore[arg-type]
