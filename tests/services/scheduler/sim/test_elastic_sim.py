"""The Tiresias / Elastic-Tiresias simulator (services/scheduler/sim/elastic.py) on traces
small enough to reason about by hand."""

from __future__ import annotations

import json

import pytest

from services.scheduler.elasticity.api import CommunicationBound
from services.scheduler.sim.elastic import (
    ELASTIC_TIRESIAS,
    TIRESIAS,
    ElasticTraceJob,
    philly_like_trace,
    simulate_elastic,
)

LINEAR = CommunicationBound(0.0)


def test_a_short_job_preempts_a_long_one_under_tiresias_but_shrinks_it_when_elastic() -> None:
    # the long job fills the 8 GPUs and crosses the first queue's 10,000 GPU·s after
    # 1,250 s; the short one arrives at 3,000 s and is in queue 0
    trace = [
        ElasticTraceJob("long", 0.0, 20_000.0, 8, 1, 8),
        ElasticTraceJob("short", 3_000.0, 600.0, 4, 1, 4),
    ]
    tiresias = simulate_elastic(trace, 8, TIRESIAS, model=LINEAR)
    elastic = simulate_elastic(trace, 8, ELASTIC_TIRESIAS, model=LINEAR)
    assert tiresias.preemptions == 1 and tiresias.rescales == 0
    assert elastic.preemptions == 0 and elastic.rescales >= 1
    assert tiresias.completed == elastic.completed == 2
    # the long job keeps running at half width instead of stopping
    assert elastic.jct_s["long"] < tiresias.jct_s["long"]


def test_an_elastic_job_alone_grows_to_its_maximum_and_finishes_sooner() -> None:
    trace = [ElasticTraceJob("alone", 0.0, 3_600.0, 2, 1, 4)]
    tiresias = simulate_elastic(trace, 8, TIRESIAS, model=LINEAR)
    elastic = simulate_elastic(trace, 8, ELASTIC_TIRESIAS, model=LINEAR)
    assert tiresias.jct_s["alone"] == pytest.approx(3_600.0)
    # four learners instead of two, linear scaling, one rescale stall at the start
    assert elastic.jct_s["alone"] == pytest.approx(1_800.0, abs=5.0)


def test_every_job_of_a_philly_shaped_trace_completes_under_both_policies() -> None:
    trace = philly_like_trace(seed=1, jobs=60, cluster_gpus=32)
    for policy in (TIRESIAS, ELASTIC_TIRESIAS):
        result = simulate_elastic(trace, 32, policy)
        assert result.completed == 60
        assert 0 < result.utilization <= 1.0


def test_an_unknown_policy_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown policy 'fifo'; choose one of tiresias, elastic"):
        simulate_elastic([], 8, "fifo")


def test_rhizome_sim_elastic_prints_both_policies_side_by_side() -> None:
    from click.testing import CliRunner

    from services.scheduler.sim.cli import main

    result = CliRunner().invoke(main, ["elastic", "--seeds", "1", "--jobs", "20", "--gpus", "16"])
    assert result.exit_code == 0, result.output
    assert "tiresias          JCT mean" in result.output
    assert "elastic-tiresias  JCT mean" in result.output
    assert "Elastic-Tiresias vs Tiresias: mean JCT" in result.output
    out = CliRunner().invoke(main, ["elastic", "--seeds", "1", "--jobs", "20", "--json"])
    assert json.loads(out.output)["settings"]["jobs"] == 20
