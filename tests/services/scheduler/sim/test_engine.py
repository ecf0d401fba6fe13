from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from services.scheduler.sim.cli import main
from services.scheduler.sim.engine import PER_POD, simulate
from services.scheduler.sim.trace import TraceJob, ffdl_gang_cluster, ffdl_gang_trace, save_trace

REPO = Path(__file__).resolve().parents[4]


def test_per_pod_baseline_deadlocks_learners_where_gang_scheduling_does_not() -> None:
    trace = ffdl_gang_trace(seed=3, jobs_per_shape=20)
    per_pod = simulate(trace, ffdl_gang_cluster(), PER_POD, seed=3)
    gang = simulate(trace, ffdl_gang_cluster(), "pack", seed=3)
    assert per_pod.deadlocked_learners_max > 0 and per_pod.idle_gpu_frac_max > 0
    assert gang.deadlocked_learners_max == 0 and gang.idle_gpu_frac_max == 0
    assert gang.completed == len(trace)


def test_simulation_is_deterministic_for_a_seed() -> None:
    trace = ffdl_gang_trace(seed=1, jobs_per_shape=5)
    a = simulate(trace, ffdl_gang_cluster(), PER_POD, seed=1)
    b = simulate(trace, ffdl_gang_cluster(), PER_POD, seed=1)
    assert a.summary() == b.summary()


def test_queueing_delay_counts_from_submit_to_start() -> None:
    nodes = ffdl_gang_cluster(nodes=1, gpus_per_node=4)
    trace = [
        TraceJob("a", 0.0, 1000.0, 1, 4, "K80"),
        TraceJob("b", 10.0, 100.0, 1, 4, "K80"),
    ]
    res = simulate(trace, nodes, "pack")
    assert sorted(res.queue_delays_s) == [0.0, 990.0]
    assert res.queued_over_15min == 1  # 990 s > 900 s
    assert res.makespan_s == 1100.0


def test_cli_replay_prints_json_for_each_policy(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    save_trace([TraceJob("a", 0.0, 60.0, 2, 0, "")], trace)
    result = CliRunner().invoke(
        main,
        [
            "replay",
            "--trace",
            str(trace),
            "--cluster",
            str(REPO / "deploy" / "cluster-local.yaml"),
            "--policy",
            "pack",
            "--policy",
            "spread",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["results"]
    assert [r["policy"] for r in rows] == ["pack", "spread"] and all(
        r["completed"] == 1 for r in rows
    )


def test_cli_refuses_an_unknown_policy_by_name(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    save_trace([TraceJob("a", 0.0, 60.0, 1, 0, "")], trace)
    result = CliRunner().invoke(
        main,
        [
            "replay",
            "--trace",
            str(trace),
            "--cluster",
            str(REPO / "deploy" / "cluster-local.yaml"),
            "--policy",
            "pak",
        ],
    )
    assert result.exit_code != 0 and "unknown policy 'pak'" in result.output
