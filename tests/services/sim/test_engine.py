"""The shared event engine and the strategies against hand-computed runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.sim import traces
from services.sim.engine import BUCKETS, Sim
from services.sim.model import JobSpec, PreemptionModel, Prices, SimInputError
from services.sim.runner import markdown, money, notes, pct, simulate
from services.sim.strategies import (
    Adaptive,
    CheckpointRestart,
    OnDemand,
    RedundancyParams,
    Redundant,
    factories,
)

PRICES = Prices(on_demand_hr=3.0, spot_hr=1.0)


def _trace(tmp_path: Path, text: str) -> traces.Trace:
    p = tmp_path / "t.csv"
    p.write_text(text)
    return traces.load(p)


def _model(tmp_path: Path, text: str, notice: float) -> PreemptionModel:
    return PreemptionModel(notice_s=notice, trace=_trace(tmp_path, text), random_offset=False)


# One node, preempted once at t = 350 s; the last line only makes the trace long.
ONE_PREEMPTION = "0,add,n1\n350000,remove,n1\n100000000,add,n2\n"


def _small_job(**kw: object) -> JobSpec:
    base: dict[str, object] = dict(
        name="t",
        steps=330,
        step_s=1.0,
        save_s=10.0,
        backup_s=0.0,
        alloc_s=(50.0, 50.0),
        prep_s=(20.0, 20.0),
    )
    base.update(kw)
    return JobSpec(**base)  # type: ignore[arg-type]


def test_on_demand_takes_the_ideal_time_at_the_on_demand_price() -> None:
    job = _small_job(steps=3600, stages=2, pipelines=2)
    model = PreemptionModel(mttp_node_s=10.0)  # ignored: on-demand is never preempted
    r = Sim(job, model, OnDemand(), PRICES, seed=1).run()
    assert r.finished and r.time_s == pytest.approx(3600.0)
    assert r.cost == pytest.approx(1.0 * 4 * 3.0)
    assert r.breakdown["compute"] == pytest.approx(3600.0)


def test_checkpoint_restart_loses_the_work_since_the_last_save(tmp_path: Path) -> None:
    # saves at 100-110, 210-220, 320-330 (progress 100, 200, 300); preempted at 350 with
    # progress 320: back to 300, 50 s allocation, 20 s preparation, 30 steps from 420.
    r = Sim(
        _small_job(),
        _model(tmp_path, ONE_PREEMPTION, 0.0),
        CheckpointRestart(100.0),
        PRICES,
        seed=0,
    ).run()
    assert r.finished and r.preemptions == 1 and r.restarts == 1
    assert r.time_s == pytest.approx(450.0)
    b = r.breakdown
    assert (b["compute"], b["recompute"], b["save"]) == pytest.approx((330.0, 20.0, 30.0))
    assert (b["allocation"], b["preparation"]) == pytest.approx((50.0, 20.0))
    assert sum(b.values()) == pytest.approx(r.time_s)


def test_adaptive_emergency_save_loses_nothing(tmp_path: Path) -> None:
    # Notice at 250 s (100 s before). Step + δ + β = 11 s fits, so no insurance saves;
    # training goes on until 1 + 2 * 11 = 23 s are left (t = 327), then save (10 s),
    # stop until 350, restart from step 327: 50 + 20 s, 3 steps left -> done at 423.
    r = Sim(_small_job(), _model(tmp_path, ONE_PREEMPTION, 100.0), Adaptive(), PRICES, seed=0).run()
    assert r.finished and r.time_s == pytest.approx(423.0)
    b = r.breakdown
    assert b["recompute"] == pytest.approx(0.0)
    assert (b["compute"], b["save"], b["allocation"], b["preparation"]) == pytest.approx(
        (330.0, 10.0, 13.0 + 50.0, 20.0)
    )


def test_adaptive_insurance_interval_is_daly_when_no_notice_fits(tmp_path: Path) -> None:
    job = _small_job(steps=10_000, save_s=8.0)
    adaptive = Adaptive(platform_mttp_s=3600.0)
    sim = Sim(job, PreemptionModel(mttp_node_s=1e12, notice_s=0.0), adaptive, PRICES, seed=0)
    sim.run()
    # No preemption seen: MTTP stays ~ the platform's (3600 s + elapsed ~ 0 at start);
    # the first interval is sqrt(2 * 8 * (3600 + 70)) = 242.3 s.
    assert adaptive.insurance_saves > 0
    assert adaptive.emergency_saves == 0


def test_redundant_fails_over_then_dies_on_consecutive_losses(tmp_path: Path) -> None:
    # Two stages, one pipeline: the first loss fails over (5 s pause, half speed); the
    # second takes the shadow too, which is fatal: back to step 0 (no checkpoint yet).
    text = "0,add,a\n0,add,b\n100000,remove,a\n150000,remove,b\n1000000000,add,c\n"
    job = _small_job(
        steps=300, stages=2, pipelines=1, alloc_s=(1000.0, 1000.0), prep_s=(10.0, 10.0)
    )
    params = RedundancyParams(
        overhead=0.0, failover_s=5.0, reconfig_s=0.0, degraded_slowdown=2.0, checkpoint_every_s=1e6
    )
    r = Sim(job, _model(tmp_path, text, 0.0), Redundant(params), PRICES, seed=0).run()
    assert (r.failovers, r.restarts) == (1, 1)
    b = r.breakdown
    assert b["failover"] == pytest.approx(5.0)
    assert b["recompute"] == pytest.approx(122.5)  # 100 + 45 s at half speed
    assert b["redundancy"] == pytest.approx(22.5)
    assert (b["allocation"], b["preparation"]) == pytest.approx((1000.0, 10.0))
    assert r.time_s == pytest.approx(1460.0)


def test_redundant_pays_its_overhead_every_iteration() -> None:
    job = _small_job(steps=1000)
    params = RedundancyParams(overhead=0.25, checkpoint_every_s=1e9)
    r = Sim(job, PreemptionModel(mttp_node_s=1e15), Redundant(params), PRICES, seed=0).run()
    assert r.time_s == pytest.approx(1250.0)
    assert r.breakdown["redundancy"] == pytest.approx(250.0)


def test_runs_are_seeded_and_buckets_add_up() -> None:
    job = JobSpec("j", steps=5000, step_s=2.0, save_s=20.0, backup_s=30.0, stages=4, pipelines=2)
    model = PreemptionModel(mttp_node_s=4 * 3600.0, notice_s=30.0)
    strategies = factories(
        ["checkpoint-restart", "adaptive", "redundant"],
        intervals_s=[600.0],
        redundancy=RedundancyParams(),
    )
    a = simulate(job, model, PRICES, strategies, runs=3, seed=7)
    b = simulate(job, model, PRICES, strategies, runs=3, seed=7)
    c = simulate(job, model, PRICES, strategies, runs=3, seed=8)
    assert [r.to_dict() for r in a] == [r.to_dict() for r in b]
    assert [r.time_h for r in a] != [r.time_h for r in c]
    for row in a:
        assert sum(row.breakdown_share.values()) == pytest.approx(1.0)
        assert set(row.breakdown_share) == set(BUCKETS)


def test_bad_inputs_are_named() -> None:
    with pytest.raises(SimInputError, match="steps must be >= 1"):
        JobSpec("j", steps=0, step_s=1.0, save_s=1.0, backup_s=1.0)
    with pytest.raises(SimInputError, match="alloc_s must be a range"):
        JobSpec("j", steps=1, step_s=1.0, save_s=1.0, backup_s=1.0, alloc_s=(5.0, 1.0))
    with pytest.raises(SimInputError, match="a trace or a node MTTP"):
        PreemptionModel()
    with pytest.raises(SimInputError, match="unknown strategy 'magic'"):
        factories(["magic"], intervals_s=[1.0], redundancy=RedundancyParams())


# --- issue #20: runs cut at the horizon credit only what they trained ------------------


def test_a_run_cut_at_the_horizon_is_credited_only_with_the_steps_it_kept(
    tmp_path: Path,
) -> None:
    # As in the checkpoint-restart test above, but the horizon is 1.3 x 330 s = 429 s:
    # back to step 300 at 350, training again from 420, so 309 steps at the horizon.
    job = _small_job(samples_per_step=10)
    sim = Sim(
        job,
        _model(tmp_path, ONE_PREEMPTION, 0.0),
        CheckpointRestart(100.0),
        PRICES,
        seed=0,
        max_time_factor=1.3,
    )
    r = sim.run()
    assert not r.finished and r.time_s == pytest.approx(429.0)
    assert r.steps_done == 309 and r.samples == 3090
    assert r.cost == pytest.approx(429.0 / 3600 * 1.0)


def test_a_strategy_that_never_finishes_shows_no_value() -> None:
    # A node lives 30 s on average and a restart takes 70 s: nothing is ever kept.
    job = _small_job(steps=1000, samples_per_step=8)
    rows = simulate(
        job,
        PreemptionModel(mttp_node_s=30.0, notice_s=0.0),
        PRICES,
        factories(["checkpoint-restart"], intervals_s=[600.0], redundancy=RedundancyParams()),
        runs=3,
        horizon_factor=3.0,
    )
    (row,) = rows
    assert (row.finished, row.runs) == (0, 3)
    assert row.samples_per_dollar == 0.0 and row.value_vs_on_demand == 0.0
    (warning,) = [n for n in notes(rows, job, PreemptionModel(mttp_node_s=30.0), 3.0) if "3x" in n]
    assert "finished 0/3 runs" in warning and "credited only with the steps" in warning
    assert "finished" in markdown(rows) and "| 0/3 |" in markdown(rows)


def test_shares_never_print_as_negative_zero() -> None:
    assert pct(-1e-17) == "0.0%"
    assert pct(0.1234) == "12.3%"


def test_small_costs_keep_their_cents() -> None:
    assert money(0.4249) == "0.42"
    assert money(2176.4) == "2,176"
