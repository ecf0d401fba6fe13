"""`python -m services.sim` (the spot-training simulator) and `rhizome estimate MANIFEST`.

Both simulate a job to completion under each strategy and print the strategy table:
time, cost, value (samples per dollar), and where the time went.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import yaml
from rich.console import Console

from services.client.durations import parse_duration
from services.sim import traces
from services.sim.model import JobSpec, PreemptionModel, Prices, SimInputError
from services.sim.runner import Row, render, simulate
from services.sim.strategies import REGISTRY, RedundancyParams, factories

# Approximate us-east-1 prices per node-hour (on-demand list price; spot about 30 % of
# it, which moves daily): defaults only, override with --on-demand-price / --spot-price.
INSTANCE_PRICES = {
    "p3.2xlarge": (3.06, 0.918),
    "g4dn.xlarge": (0.526, 0.158),
}
DEFAULT_INTERVALS = ("5m", "15m", "30m", "1h")


def parse_range(text: str) -> tuple[float, float]:
    """`60-300` (seconds; suffixes allowed) or a single value -> (low, high)."""
    parts = str(text).split("-")
    if len(parts) == 1:
        v = parse_duration(parts[0])
        return (v, v)
    if len(parts) != 2:
        raise click.BadParameter(f"{text!r} is not a range; write e.g. 60-300 or 1m-5m")
    return (parse_duration(parts[0]), parse_duration(parts[1]))


def _opt(*decls: str, **kw: Any) -> Callable[[Any], Any]:
    return click.option(*decls, **kw)


_SIM_OPTIONS = [
    _opt("--steps", type=int, help="Training steps (iterations) to complete."),
    _opt("--step-time", type=str, help="Seconds per step on the full cluster, e.g. 4 or 4s."),
    _opt("--save-time", type=str, help="δ: seconds a save blocks training."),
    _opt("--backup-time", type=str, help="β: seconds to upload a save to the object store."),
    _opt("--alloc-time", type=str, help="Range for getting a replacement node, e.g. 60-300."),
    _opt("--prep-time", type=str, help="Range for preparing after allocation (boot, load)."),
    _opt("--stages", type=int, help="Pipeline stages P (nodes = stages x pipelines)."),
    _opt("--pipelines", type=int, help="Data-parallel pipelines D."),
    _opt("--samples-per-step", type=int, help="Samples in one step (global batch)."),
    _opt("--on-demand-price", type=float, help="On-demand $ per node-hour."),
    _opt("--spot-price", type=float, help="Spot $ per node-hour."),
    _opt(
        "--trace",
        type=str,
        help="Preemption trace: a path or a bundled trace name such as aws-p3-64.csv.",
    ),
    _opt(
        "--mttp", type=str, help="Instead of a trace: mean time to preemption of one node, e.g. 3h."
    ),
    _opt(
        "--notice",
        type=str,
        default="120s",
        show_default=True,
        help="Notice before each preemption (AWS 120s, GCP/Azure 30s, 0 = none).",
    ),
    _opt(
        "--strategy",
        "strategies",
        multiple=True,
        type=click.Choice(REGISTRY.names()),
        help="Strategy to simulate; repeat for several (default: all).",
    ),
    _opt(
        "--interval",
        "intervals",
        multiple=True,
        help="Checkpoint-restart interval; repeat for several (default: 5m 15m 30m 1h).",
    ),
    _opt(
        "--overhead",
        type=float,
        default=RedundancyParams.overhead,
        show_default=True,
        help="Redundant: per-iteration overhead (Bamboo eager FRC + lazy BRC, BERT).",
    ),
    _opt(
        "--failover",
        type=str,
        default=f"{RedundancyParams.failover_s:g}s",
        show_default=True,
        help="Redundant: pause while a shadow takes over (assumed).",
    ),
    _opt(
        "--reconfig",
        type=str,
        default=f"{RedundancyParams.reconfig_s:g}s",
        show_default=True,
        help="Redundant: pause to reconfigure when replacements arrive (assumed).",
    ),
    _opt(
        "--degraded-slowdown",
        type=float,
        default=RedundancyParams.degraded_slowdown,
        show_default=True,
        help="Redundant: slowdown while a shadow runs two stages (assumed).",
    ),
    _opt(
        "--redundant-checkpoint-every",
        type=str,
        default=f"{RedundancyParams.checkpoint_every_s:g}s",
        show_default=True,
        help="Redundant: checkpoint interval kept for fatal failures.",
    ),
    _opt("--runs", type=int, default=10, show_default=True, help="Seeded runs to average."),
    _opt("--seed", type=int, default=0, show_default=True, help="Base seed."),
    _opt("--json", "as_json", is_flag=True, help="Print the rows as JSON instead of a table."),
]


def sim_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_SIM_OPTIONS):
        fn = option(fn)
    return fn


def _build(base: dict[str, Any], opts: dict[str, Any]) -> tuple[JobSpec, PreemptionModel, Prices]:
    """Merge manifest values (`base`) with options (which win) into simulator inputs."""
    merged = dict(base)
    for key, value in opts.items():
        if value is not None and value != ():
            merged[key] = value
    missing = [k for k in ("steps", "step_time", "save_time") if merged.get(k) is None]
    if missing:
        flags = ", ".join("--" + k.replace("_", "-") for k in missing)
        raise click.UsageError(f"missing {flags} (or the manifest's estimate: section)")
    prices = (merged.get("on_demand_price"), merged.get("spot_price"))
    if None in prices:
        raise click.UsageError(
            "no prices: pass --on-demand-price and --spot-price (or an instance_type the "
            f"estimator knows: {', '.join(INSTANCE_PRICES)})"
        )
    if (merged.get("trace") is None) == (merged.get("mttp") is None):
        raise click.UsageError("give exactly one preemption model: --trace FILE or --mttp DURATION")
    try:
        job = JobSpec(
            name=str(merged.get("name") or "job"),
            steps=int(merged["steps"]),
            step_s=parse_duration(merged["step_time"]),
            save_s=parse_duration(merged["save_time"]),
            backup_s=parse_duration(merged.get("backup_time") or "0"),
            alloc_s=parse_range(merged.get("alloc_time") or "60-300"),
            prep_s=parse_range(merged.get("prep_time") or "60-180"),
            stages=int(merged.get("stages") or 1),
            pipelines=int(merged.get("pipelines") or 1),
            samples_per_step=int(merged.get("samples_per_step") or 1),
        )
        trace = traces.load(merged["trace"]) if merged.get("trace") else None
        model = PreemptionModel(
            notice_s=parse_duration(merged.get("notice") or "120s"),
            trace=trace,
            mttp_node_s=parse_duration(merged["mttp"]) if merged.get("mttp") else None,
        )
        return job, model, Prices(float(prices[0]), float(prices[1]))  # type: ignore[arg-type]
    except (SimInputError, traces.TraceError) as err:
        raise click.UsageError(str(err)) from err


def _run(job: JobSpec, model: PreemptionModel, prices: Prices, opts: dict[str, Any]) -> list[Row]:
    try:
        redundancy = RedundancyParams(
            overhead=opts["overhead"],
            failover_s=parse_duration(opts["failover"]),
            reconfig_s=parse_duration(opts["reconfig"]),
            degraded_slowdown=opts["degraded_slowdown"],
            checkpoint_every_s=parse_duration(opts["redundant_checkpoint_every"]),
        )
        names = list(opts["strategies"]) or REGISTRY.names()
        intervals = [parse_duration(i) for i in (opts["intervals"] or DEFAULT_INTERVALS)]
        strategies = factories(names, intervals_s=intervals, redundancy=redundancy)
        rows = simulate(job, model, prices, strategies, runs=opts["runs"], seed=opts["seed"])
    except (SimInputError, ValueError) as err:
        raise click.UsageError(str(err)) from err
    if opts["as_json"]:
        click.echo(
            json.dumps(
                {"job": job.name, "model": model.label, "rows": [r.to_dict() for r in rows]},
                indent=2,
            )
        )
    else:
        title = (
            f"{job.name}: {job.steps} steps x {job.step_s:g}s on {job.nodes} nodes, "
            f"{model.label}, {model.job_rate_hr(job.nodes):.2f} preemptions/h, "
            f"notice {model.notice_s:g}s ({opts['runs']} runs)"
        )
        render(rows, title, Console(width=220))
    return rows


@click.command(name="simulate")
@click.option("--name", default="job", show_default=True, help="Job name for the table.")
@sim_options
def simulate_cmd(name: str, **opts: Any) -> None:
    """Simulate a job on spot nodes to completion under each strategy.

    Strategies: on-demand, checkpoint-restart (one row per --interval), adaptive
    (emergency save on notice + Daly insurance saves, Spotify) and redundant
    (Bamboo). Durations take s/m/h suffixes. Prints time, cost, samples per dollar and
    the share of time in compute, recompute, save, allocation, preparation, failover
    and redundancy, averaged over --runs seeded runs.
    """
    job, model, prices = _build({"name": name}, {k: v for k, v in opts.items() if k in _JOB_KEYS})
    _run(job, model, prices, opts)


_JOB_KEYS = {
    "steps",
    "step_time",
    "save_time",
    "backup_time",
    "alloc_time",
    "prep_time",
    "stages",
    "pipelines",
    "samples_per_step",
    "on_demand_price",
    "spot_price",
    "trace",
    "mttp",
    "notice",
}


def _manifest_fields(path: Path) -> dict[str, Any]:
    """Read the few manifest fields the estimate needs, defensively."""
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise click.BadParameter(f"cannot read manifest {path}: {err}") from err
    if not isinstance(doc, dict):
        raise click.BadParameter(f"manifest {path} must be a YAML mapping (name, learners, ...)")
    out: dict[str, Any] = {"name": doc.get("name") or path.stem}
    pipeline = doc.get("pipeline") or {}
    if not isinstance(pipeline, dict):
        raise click.BadParameter("manifest pipeline: must be a mapping {stages, pipelines}")
    if pipeline:
        out["stages"] = pipeline.get("stages")
        out["pipelines"] = pipeline.get("pipelines")
    elif doc.get("learners") is not None:
        out["pipelines"] = doc.get("learners")
    for key in ("stages", "pipelines"):
        if out.get(key) is not None and (not isinstance(out[key], int) or out[key] < 1):
            raise click.BadParameter(
                f"manifest {key} must be a whole number >= 1, got {out[key]!r}"
            )
    est = doc.get("estimate") or {}
    if not isinstance(est, dict):
        raise click.BadParameter("manifest estimate: must be a mapping (steps, step_time, ...)")
    for key in (
        "steps",
        "step_time",
        "save_time",
        "backup_time",
        "alloc_time",
        "prep_time",
        "samples_per_step",
        "notice",
    ):
        if est.get(key) is not None:
            out[key] = est[key]
    for key in ("alloc_time", "prep_time"):
        if isinstance(out.get(key), list) and len(out[key]) == 2:
            out[key] = f"{out[key][0]}-{out[key][1]}"
    itype = doc.get("instance_type")
    if itype in INSTANCE_PRICES:
        out["on_demand_price"], out["spot_price"] = INSTANCE_PRICES[itype]
    prices = est.get("prices") or {}
    if isinstance(prices, dict):
        out["on_demand_price"] = prices.get("on_demand", out.get("on_demand_price"))
        out["spot_price"] = prices.get("spot", out.get("spot_price"))
    return out


@click.command(name="estimate")
@click.argument("manifest", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@sim_options
def estimate(manifest: Path, **opts: Any) -> None:
    """What will MANIFEST cost on spot, by strategy?

    Reads name, learners or pipeline {stages, pipelines}, instance_type (for default
    prices) and an optional estimate: section (steps, step_time, save_time,
    backup_time, alloc_time, prep_time, samples_per_step, notice, prices {on_demand,
    spot}); every option below overrides the manifest. Give --trace FILE or --mttp.
    """
    base = _manifest_fields(manifest)
    job, model, prices = _build(base, {k: v for k, v in opts.items() if k in _JOB_KEYS})
    _run(job, model, prices, opts)


def main() -> None:
    simulate_cmd(prog_name="python -m services.sim")


if __name__ == "__main__":
    main()
