"""`python -m services.sim` (the spot-training simulator) and `rhizome estimate MANIFEST`.

Both simulate a job to completion under each strategy and print the strategy table:
time, cost, value (samples per dollar), and where the time went.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from services.client.durations import parse_duration
from services.manifest import ManifestError, parse_manifest
from services.sim import traces
from services.sim.model import JobSpec, PreemptionModel, Prices, SimInputError
from services.sim.runner import HORIZON_FACTOR, Row, notes, render, simulate
from services.sim.strategies import (
    REGISTRY,
    RedundancyParams,
    daly_start_interval_s,
    factories,
)

# Approximate us-east-1 prices per node-hour (on-demand list price; spot about 30 % of
# it, which moves daily): defaults only, override with --on-demand-price / --spot-price.
INSTANCE_PRICES = {
    "p3.2xlarge": (3.06, 0.918),
    "g4dn.xlarge": (0.526, 0.158),
}
DEFAULT_INTERVALS = ("5m", "15m", "30m", "1h")
DEFAULT_NOTICE = "120s"


def mttp_from_hourly_probability(p: float) -> float:
    """Node MTTP (s) for a per-node, per-hour preemption probability `p`.

    Node lifetimes are exponential (memoryless), so P(preempted within an hour) =
    1 - exp(-3600 / MTTP), i.e. MTTP = 3600 / -ln(1 - p): p = 0.1 is MTTP 9.5 h, not 10 h.
    """
    if not 0 < p < 1:
        raise SimInputError(
            f"--preemption-probability must be between 0 and 1 (exclusive), the chance "
            f"that one node is preempted within an hour, e.g. 0.05; got {p:g}"
        )
    return 3600.0 / -math.log1p(-p)


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
        "--preemption-probability",
        type=float,
        help="Instead of a trace or --mttp: chance that one node is preempted within an hour, "
        "between 0 and 1 (Bamboo's simulator's input), e.g. 0.05.",
    ),
    _opt(
        "--notice",
        type=str,
        help="Notice before each preemption (AWS 120s, GCP/Azure 30s, 0 = none); default: "
        f"the manifest's estimate.notice, else {DEFAULT_NOTICE}.",
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
        help="Checkpoint-restart interval; repeat for several (default: 5m 15m 30m 1h "
        "unless --interval-steps is given).",
    ),
    _opt(
        "--interval-steps",
        "interval_steps",
        multiple=True,
        type=int,
        help="Checkpoint-restart interval in training steps, e.g. 500; repeat for several.",
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
    _opt(
        "--runs",
        type=click.IntRange(min=1),
        default=10,
        show_default=True,
        help="Seeded runs to average.",
    ),
    _opt("--seed", type=int, default=0, show_default=True, help="Base seed."),
    _opt("--json", "as_json", is_flag=True, help="Print the rows as JSON instead of a table."),
]


def sim_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_SIM_OPTIONS):
        fn = option(fn)
    return fn


def build_inputs(
    base: dict[str, Any], opts: dict[str, Any]
) -> tuple[JobSpec, PreemptionModel, Prices]:
    """Merge manifest values (`base`) with the options given (which win) into simulator
    inputs. An option not given is None here (none of these has a click default), so it
    never hides a manifest value."""
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
    given = [k for k in ("trace", "mttp", "preemption_probability") if merged.get(k) is not None]
    if len(given) != 1:
        raise click.UsageError(
            "give exactly one preemption model: --trace FILE, --mttp DURATION or "
            "--preemption-probability P"
            + (f" (got {', '.join('--' + g.replace('_', '-') for g in given)})" if given else "")
        )
    try:
        job = JobSpec(
            name=str(merged.get("name") or "job"),
            steps=_whole(merged["steps"], "steps"),
            step_s=parse_duration(merged["step_time"]),
            save_s=parse_duration(merged["save_time"]),
            backup_s=parse_duration(merged.get("backup_time") or "0"),
            alloc_s=parse_range(merged.get("alloc_time") or "60-300"),
            prep_s=parse_range(merged.get("prep_time") or "60-180"),
            # `is None`, not `or`: 0 is a wrong value to report, not a missing one
            stages=_whole(_given(merged, "stages", 1), "stages"),
            pipelines=_whole(_given(merged, "pipelines", 1), "pipelines"),
            samples_per_step=_whole(_given(merged, "samples_per_step", 1), "samples_per_step"),
        )
        trace = traces.load(merged["trace"]) if merged.get("trace") else None
        if merged.get("preemption_probability") is not None:
            mttp: float | None = mttp_from_hourly_probability(
                float(merged["preemption_probability"])
            )
        else:
            mttp = parse_duration(merged["mttp"]) if merged.get("mttp") else None
        model = PreemptionModel(
            # 0 is a notice (none at all), not "unset"
            notice_s=parse_duration(
                DEFAULT_NOTICE if merged.get("notice") is None else merged["notice"]
            ),
            trace=trace,
            mttp_node_s=mttp,
        )
        return job, model, Prices(_price(prices[0], "on-demand"), _price(prices[1], "spot"))
    except (SimInputError, traces.TraceError) as err:
        raise click.UsageError(str(err)) from err
    except (ValueError, TypeError) as err:
        raise click.UsageError(f"bad estimate input: {err}") from err


def _given(merged: dict[str, Any], key: str, default: Any) -> Any:
    return default if merged.get(key) is None else merged[key]


def _price(value: Any, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise SimInputError(
            f"the {name} price must be a number of dollars per node-hour, got {value!r}"
        ) from None


def _whole(value: Any, name: str) -> int:
    if isinstance(value, bool) or not str(value).strip().isdigit():
        raise SimInputError(f"{name} must be a whole number >= 1, got {value!r}")
    if int(str(value).strip()) < 1:
        raise SimInputError(f"{name} must be >= 1, got {value!r}")
    return int(str(value).strip())


def _intervals(opts: dict[str, Any], job: JobSpec) -> list[tuple[float, str | None]]:
    """(seconds, label) of each checkpoint-restart interval: --interval durations, then
    --interval-steps (steps × step time, labelled in steps); the defaults when neither."""
    out: list[tuple[float, str | None]] = []
    for text in opts["intervals"]:
        seconds = parse_duration(text)
        if not seconds > 0:
            raise SimInputError(f"--interval {text}: a checkpoint interval must be > 0, e.g. 15m")
        out.append((seconds, None))
    for steps in opts["interval_steps"]:
        if steps < 1:
            raise SimInputError(
                f"--interval-steps {steps}: a checkpoint interval must be >= 1 step, e.g. 500"
            )
        out.append((steps * job.step_s, f"{steps} steps"))
    return out or [(parse_duration(i), None) for i in DEFAULT_INTERVALS]


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
        strategies = factories(names, intervals=_intervals(opts, job), redundancy=redundancy)
        rows = simulate(job, model, prices, strategies, runs=opts["runs"], seed=opts["seed"])
    except (SimInputError, ValueError) as err:
        raise click.UsageError(str(err)) from err
    remarks = notes(rows, job, model, HORIZON_FACTOR)
    if opts["as_json"]:
        tau, mttp = daly_start_interval_s(job, model)
        click.echo(
            json.dumps(
                {
                    "job": job.name,
                    "model": model.label,
                    "notice_s": model.notice_s,
                    "job_mttp_s": mttp,
                    "daly_interval_s": tau,
                    "horizon_s": job.ideal_s * HORIZON_FACTOR,
                    "rows": [r.to_dict() for r in rows],
                    "notes": remarks,
                },
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
        for remark in remarks:
            click.echo(remark)
    return rows


@click.command(name="simulate")
@click.option("--name", default="job", show_default=True, help="Job name for the table.")
@sim_options
def simulate_cmd(name: str, **opts: Any) -> None:
    """Simulate a job on spot nodes to completion under each strategy.

    Strategies: on-demand, checkpoint-restart (one row per --interval or
    --interval-steps), adaptive (emergency save on notice + Daly insurance saves,
    Spotify) and redundant (Bamboo). Durations take s/m/h suffixes. Prints time, cost,
    samples per dollar and the share of time in compute, recompute, save, allocation,
    preparation, failover and redundancy, averaged over --runs seeded runs, with how
    many runs finished (a run still going at 20x the ideal time is stopped and credited
    only with the steps it trained). docs/simulators.md describes the model.
    """
    job, model, prices = build_inputs(
        {"name": name}, {k: v for k, v in opts.items() if k in _JOB_KEYS}
    )
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
    "preemption_probability",
    "notice",
}


def manifest_fields(path: Path) -> dict[str, Any]:
    """The simulator inputs a job manifest gives, read through the typed Manifest (the
    same parser and schema the API uses at submit)."""
    try:
        manifest = parse_manifest(path.read_bytes())
    except OSError as err:
        raise click.BadParameter(f"cannot read manifest {path}: {err}") from err
    except ManifestError as err:
        raise click.BadParameter(f"manifest {path}: {err}") from None
    out: dict[str, Any] = {"name": manifest.name or path.stem}
    if manifest.pipeline is not None:
        out["stages"] = manifest.pipeline.stages
        out["pipelines"] = manifest.pipeline.pipelines
    else:
        out["pipelines"] = manifest.learners
    est = manifest.estimate
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
        if isinstance(out.get(key), list):
            if len(out[key]) != 2:
                raise click.BadParameter(
                    f"manifest {path}: estimate.{key} must be [low, high] or low-high, "
                    f"got {out[key]!r}"
                )
            out[key] = f"{out[key][0]}-{out[key][1]}"
    if manifest.instance_type in INSTANCE_PRICES:
        out["on_demand_price"], out["spot_price"] = INSTANCE_PRICES[manifest.instance_type]
    prices = est.get("prices")
    if prices is not None:
        if not isinstance(prices, dict) or set(prices) - {"on_demand", "spot"}:
            raise click.BadParameter(
                f"manifest {path}: estimate.prices must be {{on_demand: $/node-hour, "
                f"spot: $/node-hour}}, got {prices!r}"
            )
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
    spot}); an option given overrides the manifest, an option not given leaves it be.
    Give --trace FILE, --mttp or --preemption-probability.
    """
    base = manifest_fields(manifest)
    job, model, prices = build_inputs(base, {k: v for k, v in opts.items() if k in _JOB_KEYS})
    _run(job, model, prices, opts)


def main() -> None:
    # No prog_name: click names the program as it was run (`rhizome-spot-sim`, or
    # `python -m services.sim`), so usage lines in errors show a command that works.
    simulate_cmd()


if __name__ == "__main__":
    main()
