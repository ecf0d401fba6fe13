"""The cluster simulator: its measures against hand-made cases, and its CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from services.scheduler.cluster import Node
from services.scheduler.sim.cli import main
from services.scheduler.sim.engine import PER_POD, simulate
from services.scheduler.sim.trace import (
    TraceError,
    TraceJob,
    ffdl_gang_cluster,
    ffdl_gang_trace,
    load_trace,
    save_trace,
)

REPO = Path(__file__).resolve().parents[4]
HEADER = "job_id,arrival_s,duration_s,learners,gpus,gpu_type\n"


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


def _trace_file(tmp_path: Path, *jobs: TraceJob) -> Path:
    """``jobs`` (by default one 2-learner CPU job) as a JSON trace file."""
    trace = tmp_path / "trace.json"
    save_trace(list(jobs) or [TraceJob("a", 0.0, 60.0, 2, 0, "")], trace)
    return trace


def _replay(
    trace: Path,
    *options: str,
    cluster: Path = REPO / "deploy" / "cluster-local.yaml",
    env: dict[str, str] | None = None,
) -> Result:
    """``replay --trace TRACE --cluster CLUSTER OPTIONS`` through the CLI."""
    return CliRunner(env=env).invoke(
        main, ["replay", "--trace", str(trace), "--cluster", str(cluster), *options]
    )


def test_cli_replay_prints_json_for_each_policy(tmp_path: Path) -> None:
    result = _replay(_trace_file(tmp_path), "--policy", "pack", "--policy", "spread", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["results"]
    assert [r["policy"] for r in rows] == ["pack", "spread"] and all(
        r["completed"] == 1 for r in rows
    )


def test_cli_refuses_an_unknown_policy_by_name(tmp_path: Path) -> None:
    result = _replay(_trace_file(tmp_path, TraceJob("a", 0.0, 60.0, 1, 0, "")), "--policy", "pak")
    assert result.exit_code != 0 and "unknown policy 'pak'" in result.output


# --- issue #20: a deadlock is contention, not siblings still to come --------------------


def test_one_job_alone_on_an_empty_cluster_is_never_deadlocked() -> None:
    # Its pods appear over 5 s; the first ones wait for their siblings, which then fit.
    nodes = ffdl_gang_cluster(nodes=1, gpus_per_node=4)
    for seed in range(5):
        res = simulate([TraceJob("a", 0.0, 600.0, 4, 1, "K80")], nodes, PER_POD, seed=seed)
        assert res.deadlocked_learners_max == 0 and res.idle_gpu_frac_max == 0
        assert res.waiting_for_siblings_max > 0
        assert res.completed == 1


def test_jobs_that_exactly_fill_the_cluster_are_not_deadlocked() -> None:
    # 8 one-GPU pods on 8 GPUs: every pod fits whatever the order, nobody waits on anybody.
    nodes = ffdl_gang_cluster(nodes=2, gpus_per_node=4)
    trace = [TraceJob(f"j{i}", 0.0, 600.0, 2, 1, "K80") for i in range(4)]
    for seed in range(5):
        res = simulate(trace, nodes, PER_POD, seed=seed)
        assert res.deadlocked_learners_max == 0, seed
        assert res.waiting_for_siblings_max > 0
        assert res.completed == 4


def test_pods_kept_out_by_another_job_are_deadlocked() -> None:
    # Two 2-learner x 2-GPU jobs on one 4-GPU node: when one pod of each binds first,
    # all pods exist and each job's last pod needs what the other holds.
    nodes = ffdl_gang_cluster(nodes=1, gpus_per_node=4)
    trace = [TraceJob("a", 0.0, 600.0, 2, 2, "K80"), TraceJob("b", 0.0, 600.0, 2, 2, "K80")]
    results = [
        simulate(trace, nodes, PER_POD, seed=s, deploy_gap_s=0.0, pod_spread_s=10.0)
        for s in range(20)
    ]
    stuck = [r for r in results if r.deadlocked_learners_max > 0]
    assert stuck, "no seed interleaved the two jobs' pods"
    for r in stuck:
        assert r.deadlocked_learners_max == 2 and r.idle_gpu_frac_max == 1.0
        assert r.permanent_deadlock and r.completed == 0
    for r in results:
        if r not in stuck:
            assert r.completed == 2
    gang = simulate(trace, nodes, "pack", seed=0)
    assert gang.deadlocked_learners_max == 0 and gang.completed == 2


def test_ffdl_gang_takes_the_cluster_and_job_shapes() -> None:
    result = CliRunner().invoke(
        main,
        [
            "ffdl-gang",
            "--nodes",
            "2",
            "--gpus-per-node",
            "4",
            "--shapes",
            "1x4,2x2",
            "--jobs-per-shape",
            "2",
            "--runs",
            "2",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    run = doc["runs"]["pack"][0]
    assert run["jobs"] == 4 and run["completed"] == 4
    assert {row["policy"] for row in doc["summary"]} == {PER_POD, "spread", "pack"}
    bad = CliRunner().invoke(main, ["ffdl-gang", "--shapes", "2by1"])
    assert bad.exit_code == 2 and "'2by1' is not a job shape" in bad.output


def test_replay_runs_several_seeds_and_averages(tmp_path: Path) -> None:
    trace = _trace_file(
        tmp_path, TraceJob("a", 0.0, 60.0, 2, 0, ""), TraceJob("b", 5.0, 120.0, 1, 0, "")
    )
    result = _replay(trace, "--policy", "pack", "--policy", PER_POD, "--runs", "3", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert [len(doc["runs"][p]) for p in ("pack", PER_POD)] == [3, 3]
    assert [r["seed"] for r in doc["runs"]["pack"]] == [0, 1, 2]
    pack = doc["results"][0]
    assert pack["runs"] == 3 and pack["completed"] == 2.0


def test_replay_table_shows_every_metric_name_whole_at_80_columns(tmp_path: Path) -> None:
    result = _replay(
        _trace_file(tmp_path), "--policy", "pack", "--policy", "spread", env={"COLUMNS": "80"}
    )
    assert result.exit_code == 0, result.output
    for metric in simulate(
        [TraceJob("a", 0.0, 1.0, 1, 0, "")], ffdl_gang_cluster(), "pack"
    ).summary():
        if metric != "policy":
            assert metric in result.output, metric
    assert max(len(line) for line in result.output.splitlines()) <= 80


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("t.csv", "", "the trace is empty"),
        ("t.csv", "job_id,arrival_s\na,0\n", ":2: no duration_s column"),
        ("t.csv", HEADER + "a,0,60,two,1,K80\n", ":2: invalid literal"),
        ("t.csv", HEADER + "a,0,60,1,1,K80\na,5,60,1,1,K80\n", ":3: job_id a appears twice"),
        ("t.csv", HEADER + "a,0,-5,1,1,K80\n", ":2: job a: need arrival_s >= 0, duration_s > 0"),
        ("t.json", "[{", ":1: not valid JSON"),
        ("t.json", '{"a": 1}', "a JSON trace is a list of jobs"),
    ],
)
def test_bad_job_traces_are_one_line_naming_the_row(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    trace = tmp_path / name
    trace.write_text(text)
    with pytest.raises(TraceError) as err:
        load_trace(trace)
    assert message in str(err.value) and "\n" not in str(err.value)
    result = _replay(trace)
    assert result.exit_code == 2 and message in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["ffdl-pack", "--load", "0"], "--load"),
        (["ffdl-pack", "--seeds", "0"], "--seeds"),
        (["ffdl-pack", "--hours", "-1"], "--hours"),
        (["ffdl-gang", "--runs", "0"], "--runs"),
        (["ffdl-gang", "--deploy-gap", "-1"], "--deploy-gap"),
    ],
)
def test_out_of_range_experiment_options_are_refused_by_name(args: list[str], option: str) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and f"Invalid value for '{option}'" in result.output


def test_replay_refuses_a_bad_cluster_config_in_one_line(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("nodes:\n  - name: a\n    cpus: 2\n    memory_mb: 1024\n    gpuz: 2\n")
    result = _replay(_trace_file(tmp_path), cluster=cluster)
    assert result.exit_code == 2 and "--cluster" in result.output and "gpuz" in result.output
    assert "Traceback" not in result.output


def test_cpu_pods_kept_out_by_another_job_are_deadlocked_too() -> None:
    # The GPU case above with CPUs: two 2-learner x 2-CPU jobs on one 4-CPU node.
    nodes = [Node("cpu-0", cpus=4, memory_mb=4096)]
    trace = [
        TraceJob("a", 0.0, 600.0, 2, 0, "", cpus=2.0),
        TraceJob("b", 0.0, 600.0, 2, 0, "", cpus=2.0),
    ]
    results = [
        simulate(trace, nodes, PER_POD, seed=s, deploy_gap_s=0.0, pod_spread_s=10.0)
        for s in range(20)
    ]
    stuck = [r for r in results if r.deadlocked_learners_max > 0]
    assert stuck and all(r.deadlocked_learners_max == 2 and r.completed == 0 for r in stuck)
    # A pod bigger than any node is unschedulable, not deadlocked.
    huge = [TraceJob("h", 0.0, 600.0, 2, 0, "", cpus=3.0)]
    res = simulate(huge, nodes, PER_POD, seed=0)
    assert res.deadlocked_learners_max == 0 and res.completed == 0
