"""``python -m services.scheduler.sim``: replay traces, reproduce FfDL §5.3 and §5.2."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from services.scheduler.api import ClusterConfigError
from services.scheduler.cluster import load_cluster_config
from services.scheduler.placement import policy_names
from services.scheduler.sim.engine import PER_POD, SimResult, simulate
from services.scheduler.sim.trace import (
    FFDL_GANG_SHAPES,
    TraceError,
    ffdl_day_trace,
    ffdl_gang_cluster,
    ffdl_gang_trace,
    ffdl_pack_cluster,
    load_trace,
)

JSON_HELP = "Print the results as JSON (one object) instead of tables."


def _table(title: str, rows: Sequence[dict[str, Any]], key: str = "policy") -> None:
    """One column per row (policy), one line per metric: metric names are long and there
    are many of them, so a table with a column per metric is cut at any usual width."""
    if not rows:
        return
    table = Table(title=title)
    table.add_column("metric", no_wrap=True)
    for row in rows:
        table.add_column(str(row[key]), justify="right", no_wrap=True)
    for metric in rows[0]:
        if metric != key:
            table.add_row(metric, *(str(row.get(metric, "")) for row in rows))
    Console().print(table)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """`2x1,2x2,4x1` (learners x GPUs per learner) -> [(2, 1), (2, 2), (4, 1)]."""
    shapes = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*[x×]\s*(\d+)\s*", part)
        if not m or int(m[1]) < 1 or int(m[2]) < 1:
            raise click.BadParameter(
                f"{part.strip()!r} is not a job shape; write LEARNERSxGPUS, e.g. 2x1,2x2,4x1",
                param_hint="--shapes",
            )
        shapes.append((int(m[1]), int(m[2])))
    return shapes


def _mean(results: Sequence[SimResult], key: str) -> float:
    return round(sum(float(r.summary()[key]) for r in results) / len(results), 1)


def gang_experiment(
    runs: int,
    seed: int,
    jobs_per_shape: int,
    deploy_gap_s: float,
    pod_spread_s: float,
    *,
    nodes: int = 15,
    gpus_per_node: int = 4,
    shapes: Sequence[tuple[int, int]] = FFDL_GANG_SHAPES,
) -> dict[str, Any]:
    """FfDL §5.3 for per-pod, gang+SPREAD and gang+PACK over ``runs`` seeds."""
    out: dict[str, Any] = {"runs": {}, "summary": []}
    for policy in (PER_POD, "spread", "pack"):
        results: list[SimResult] = [
            simulate(
                ffdl_gang_trace(seed + r, jobs_per_shape, shapes),
                ffdl_gang_cluster(nodes, gpus_per_node),
                policy,
                seed=seed + r,
                deploy_gap_s=deploy_gap_s,
                pod_spread_s=pod_spread_s,
            )
            for r in range(runs)
        ]
        out["runs"][policy] = [r.summary() for r in results]
        with_dead = [r for r in results if r.deadlocked_learners_max > 0]
        out["summary"].append(
            {
                "policy": policy,
                "runs": runs,
                "runs_with_deadlocked_learners": len(with_dead),
                "runs_with_deadlock_pct": round(100 * len(with_dead) / runs, 1),
                "deadlocked_learners_max": max(r.deadlocked_learners_max for r in results),
                "idle_gpu_pct_max": round(100 * max(r.idle_gpu_frac_max for r in results), 1),
                "waiting_for_siblings_max": max(r.waiting_for_siblings_max for r in results),
                "permanent_deadlocks": sum(r.permanent_deadlock for r in results),
                "mean_makespan_h": round(sum(r.makespan_s for r in results) / runs / 3600, 2),
            }
        )
    return out


def pack_experiment(
    seeds: int, seed: int, hours: float, load: float, backfill: bool
) -> dict[str, Any]:
    """FfDL §5.2 shape: jobs queued over 15 minutes, SPREAD vs PACK, on a 400-GPU day."""
    out: dict[str, Any] = {"runs": {}, "summary": []}
    per_policy: dict[str, list[SimResult]] = {}
    for policy in ("spread", "pack"):
        per_policy[policy] = [
            simulate(
                ffdl_day_trace(seed + r, hours, load),
                ffdl_pack_cluster(),
                policy,
                seed=seed + r,
                backfill=backfill,
            )
            for r in range(seeds)
        ]
        out["runs"][policy] = [r.summary() for r in per_policy[policy]]
    for policy, results in per_policy.items():
        out["summary"].append(
            {
                "policy": policy,
                "jobs": sum(r.jobs for r in results),
                "queued_over_15min": sum(r.queued_over_15min for r in results),
                "queue_delay_p50_min": _mean(results, "queue_delay_p50_min"),
                "utilization_pct": round(100 * sum(r.utilization for r in results) / seeds, 1),
                "jct_mean_min": _mean(results, "jct_mean_min"),
            }
        )
    spread = sum(r.queued_over_15min for r in per_policy["spread"])
    pack = sum(r.queued_over_15min for r in per_policy["pack"])
    out["spread_over_pack_queued_over_15min"] = round(spread / pack, 2) if pack else None
    return out


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Rhizome's cluster simulator: replays job traces through the real gang scheduler.

    \b
    Subcommands:
      ffdl-gang  FfDL §5.3: is a job ever left holding GPUs without all its learners?
      ffdl-pack  FfDL §5.2: how many jobs wait over 15 minutes, SPREAD vs PACK?
      replay     any trace file against any cluster config and policy
      elastic    Tiresias vs Elastic-Tiresias (Amoeba §6) on Philly-shaped traces
    """


@main.command("elastic")
@click.option(
    "--seeds",
    default=3,
    show_default=True,
    type=click.IntRange(min=1),
    help="Traces, one per seed (0, 1, ...); both policies replay each.",
)
@click.option(
    "--jobs", default=480, show_default=True, type=click.IntRange(min=1), help="Jobs per trace."
)
@click.option(
    "--gpus",
    default=64,
    show_default=True,
    type=click.IntRange(min=1),
    help="GPUs of the cluster (one per learner).",
)
@click.option(
    "--load",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0.01),
    help="Offered load of the trace (demand / capacity).",
)
@click.option(
    "--throughput",
    "throughput",
    default="measured",
    show_default=True,
    type=click.Choice(["measured", "comm-bound"]),
    help="Throughput model: the curve measured on the elastic runtime "
    "(benchmarks/elastic_throughput.py), or p / (1 + overhead (p - 1)).",
)
@click.option(
    "--throughput-curve",
    "curve",
    default=None,
    type=click.Path(dir_okay=False),
    help="A curve file written by benchmarks/elastic_throughput.py --write "
    "(--throughput measured; default: the bundled one).",
)
@click.option(
    "--overhead",
    default=None,
    type=click.FloatRange(0, 0.99),
    help="--throughput comm-bound's overhead in p / (1 + overhead (p - 1)); default 0.05.",
)
@click.option(
    "--pending-threshold",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Elastic-Tiresias shrinks when more than this many jobs wait.",
)
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def elastic(
    seeds: int,
    jobs: int,
    gpus: int,
    load: float,
    throughput: str,
    curve: str | None,
    overhead: float | None,
    pending_threshold: int,
    as_json: bool,
) -> None:
    """Tiresias vs Elastic-Tiresias on the same traces and cluster: JCT mean and p99,
    utilisation, per-size JCT (services/scheduler/sim/elastic.py)."""
    from services.scheduler.elasticity.api import ScalingConfigError
    from services.scheduler.sim.elastic import compare, format_compare

    if throughput == "measured" and overhead is not None:
        raise click.UsageError(
            "--overhead is the comm-bound model's; add --throughput comm-bound "
            "(the measured model fits its own)"
        )
    if throughput == "comm-bound" and curve is not None:
        raise click.UsageError("--throughput-curve goes with --throughput measured")
    try:
        out = compare(
            seeds,
            jobs,
            gpus,
            load,
            0.05 if overhead is None else overhead,
            pending_threshold,
            throughput=throughput,
            curve=curve,
        )
    except ScalingConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--throughput-curve") from None
    if as_json:
        click.echo(json.dumps(out))
        return
    for line in format_compare(out):
        click.echo(line)


@main.command("ffdl-gang")
@click.option(
    "--runs",
    default=20,
    show_default=True,
    type=click.IntRange(min=1),
    help="Repetitions, each with its own seed (seed, seed+1, ...).",
)
@click.option(
    "--seed",
    default=0,
    show_default=True,
    help="First seed: shuffles submit order, durations, pod timing.",
)
@click.option(
    "--jobs-per-shape",
    default=50,
    show_default=True,
    type=click.IntRange(min=1),
    help="Jobs of each shape 2×1, 2×2, 4×1 (learners × GPUs).",
)
@click.option(
    "--deploy-gap",
    "deploy_gap_s",
    default=0.5,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Per-pod baseline: mean seconds between the deployments of consecutive jobs.",
)
@click.option(
    "--pod-spread",
    "pod_spread_s",
    default=5.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Per-pod baseline: seconds over which one job's pods appear (they interleave with other jobs' pods).",
)
@click.option(
    "--nodes", default=15, show_default=True, type=click.IntRange(min=1), help="Cluster nodes."
)
@click.option(
    "--gpus-per-node",
    default=4,
    show_default=True,
    type=click.IntRange(min=1),
    help="GPUs on each node (all K80).",
)
@click.option(
    "--shapes",
    default="2x1,2x2,4x1",
    show_default=True,
    help="Job shapes, LEARNERSxGPUS per learner, comma-separated; --jobs-per-shape of each.",
)
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def ffdl_gang(
    runs: int,
    seed: int,
    jobs_per_shape: int,
    deploy_gap_s: float,
    pod_spread_s: float,
    nodes: int,
    gpus_per_node: int,
    shapes: str,
    as_json: bool,
) -> None:
    """FfDL §5.3 (by default 15 nodes × 4 GPUs, 150 jobs submitted together): per-pod vs
    gang scheduling.

    Reports, per policy, in how many runs learners were deadlocked (all their job's pods
    exist, and other jobs hold what the rest need), the most such learners and the
    largest share of GPUs they held idle, and, apart, the most learners bound while
    their siblings' pods were not created yet. FfDL measured deadlocks in 60 % of runs,
    up to 46 % GPUs idle, without gang scheduling; zero with it.
    """
    job_shapes = parse_shapes(shapes)
    out = gang_experiment(
        runs,
        seed,
        jobs_per_shape,
        deploy_gap_s,
        pod_spread_s,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        shapes=job_shapes,
    )
    if as_json:
        click.echo(json.dumps(out, indent=1))
    else:
        _table(
            f"FfDL §5.3: deadlocked learners, {nodes} nodes × {gpus_per_node} GPUs, "
            f"{jobs_per_shape * len(job_shapes)} jobs ({shapes}) submitted together",
            out["summary"],
        )


@main.command("ffdl-pack")
@click.option(
    "--seeds",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Number of synthetic days (seed, seed+1, ...); totals are summed.",
)
@click.option("--seed", default=0, show_default=True, help="First seed of the synthetic trace.")
@click.option(
    "--hours",
    default=24.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Length of the arrival trace in hours.",
)
@click.option(
    "--load",
    default=0.9,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Offered load: mean GPU demand as a share of the 400 GPUs.",
)
@click.option(
    "--backfill/--no-backfill",
    default=False,
    show_default=True,
    help="Let jobs pass a queue head that cannot fit (default: strict FCFS per GPU type, as FfDL).",
)
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def ffdl_pack(
    seeds: int, seed: int, hours: float, load: float, backfill: bool, as_json: bool
) -> None:
    """FfDL §5.2 shape on 400 GPUs (180 K80 + 220 V100): jobs queued over 15 min, SPREAD vs PACK.

    FfDL measured more than 3× fewer such jobs with PACK.
    """
    out = pack_experiment(seeds, seed, hours, load, backfill)
    if as_json:
        click.echo(json.dumps(out, indent=1))
    else:
        _table("FfDL §5.2 shape: 400 GPUs, synthetic day", out["summary"])
        click.echo(
            f"SPREAD / PACK jobs queued over 15 min: {out['spread_over_pack_queued_over_15min']}"
        )


@main.command("replay")
@click.option(
    "--trace",
    "trace_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Trace file: JSON list or CSV with job_id, arrival_s, duration_s, learners, gpus, gpu_type.",
)
@click.option(
    "--runs",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Repetitions with seeds seed, seed+1, ...; numbers are averaged over them.",
)
@click.option(
    "--cluster",
    "cluster_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Cluster config YAML (format: services/scheduler/cluster.py, e.g. deploy/cluster-local.yaml).",
)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    default=("pack",),
    show_default=True,
    help=f"Policy to compare; repeat the option for several. One of: {PER_POD}, "
    + ", ".join(policy_names())
    + ".",
)
@click.option(
    "--seed", default=0, show_default=True, help="Seed for BSA sampling and per-pod timing."
)
@click.option(
    "--backfill/--no-backfill",
    default=False,
    show_default=True,
    help="Let jobs pass a queue head that cannot fit.",
)
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def replay(
    trace_path: str,
    runs: int,
    cluster_path: str,
    policies: tuple[str, ...],
    seed: int,
    backfill: bool,
    as_json: bool,
) -> None:
    """Replay a trace against a cluster under one or more policies and compare the metrics.

    With --runs N each policy runs with N seeds (BSA sampling and the per-pod baseline's
    pod timing change with the seed; the trace does not) and each figure is the mean
    over the runs; permanent_deadlock counts the runs that had one.
    """
    try:
        trace = load_trace(trace_path)
    except TraceError as err:
        raise click.BadParameter(str(err), param_hint="--trace") from None
    try:
        nodes = load_cluster_config(cluster_path).nodes
    except ClusterConfigError as err:
        raise click.BadParameter(str(err), param_hint="--cluster") from None
    known = {PER_POD, *policy_names()}
    for p in policies:
        if p not in known:
            raise click.BadParameter(
                f"unknown policy {p!r}; choose from {', '.join(sorted(known))}",
                param_hint="--policy",
            )
    per_run = {
        p: [
            simulate(trace, nodes, p, seed=seed + r, backfill=backfill).summary()
            for r in range(runs)
        ]
        for p in policies
    }
    rows = [_average(p, per_run[p]) if runs > 1 else per_run[p][0] for p in policies]
    if as_json:
        doc: dict[str, Any] = {"results": rows}
        if runs > 1:
            doc["runs"] = per_run
        click.echo(json.dumps(doc, indent=1))
    else:
        _table(f"replay of {trace_path}" + (f", mean of {runs} runs" if runs > 1 else ""), rows)


def _average(policy: str, summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean of each number over the runs; a yes/no figure as how many runs said yes."""
    out: dict[str, Any] = {"policy": policy, "runs": len(summaries)}
    for key, value in summaries[0].items():
        if key in ("policy", "seed"):
            continue
        values = [s[key] for s in summaries]
        if isinstance(value, bool):
            out[key] = sum(values)
        else:
            out[key] = round(sum(float(v) for v in values) / len(values), 2)
    return out


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
