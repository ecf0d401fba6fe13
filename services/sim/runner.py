"""Run every strategy over N seeded runs and average; render the strategy table.

Every figure of a row is the mean over its runs. A run that has not finished by the
horizon (`HORIZON_FACTOR` times the ideal time) is stopped there: its time and cost are
what it used up to the horizon, and it is credited only with the steps it had trained
(`RunResult.steps_done`), so samples per dollar never counts work that was not done.
The `finished` column says how many of the runs finished.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from services.sim.engine import BUCKETS, RunResult, Sim
from services.sim.model import JobSpec, PreemptionModel, Prices
from services.sim.strategies import StrategyFactory, daly_start_interval_s

HORIZON_FACTOR = 20.0


@dataclass
class Row:
    strategy: str
    runs: int
    finished: int
    time_h: float
    time_vs_ideal: float
    cost: float
    cost_vs_on_demand: float
    samples_per_dollar: float
    value_vs_on_demand: float
    training_share: float
    in_training_share: float
    breakdown_share: dict[str, float]
    preemptions: float
    restarts: float
    failovers: float
    saves: float
    fatal_failures: float = 0.0
    steps_done: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def simulate(
    job: JobSpec,
    model: PreemptionModel,
    prices: Prices,
    strategies: list[StrategyFactory],
    *,
    runs: int = 10,
    seed: int = 0,
    horizon_factor: float = HORIZON_FACTOR,
) -> list[Row]:
    """Average each strategy over `runs` seeded runs (the same preemptions per seed)."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    per_strategy: dict[str, list[RunResult]] = {}
    order: list[str] = []
    for factory in strategies:
        for i in range(runs):
            strategy = factory()
            result = Sim(
                job, model, strategy, prices, seed * 100_003 + i, max_time_factor=horizon_factor
            ).run()
            if result.strategy not in per_strategy:
                per_strategy[result.strategy] = []
                order.append(result.strategy)
            per_strategy[result.strategy].append(result)
    ideal_h = job.ideal_s / 3600.0
    od_cost = ideal_h * job.nodes * prices.on_demand_hr
    od_value = job.steps * job.samples_per_step / od_cost
    rows = []
    for name in order:
        results = per_strategy[name]
        mean = statistics.fmean
        time_s = mean(r.time_s for r in results)
        cost = mean(r.cost for r in results)
        spd = mean(r.samples_per_dollar for r in results)
        shares = {
            b: mean(r.breakdown[b] / r.time_s if r.time_s else 0.0 for r in results)
            for b in BUCKETS
        }
        rows.append(
            Row(
                strategy=name,
                runs=len(results),
                finished=sum(r.finished for r in results),
                time_h=time_s / 3600.0,
                time_vs_ideal=time_s / job.ideal_s,
                cost=cost,
                cost_vs_on_demand=cost / od_cost,
                samples_per_dollar=spd,
                value_vs_on_demand=spd / od_value,
                training_share=shares["compute"],
                in_training_share=shares["compute"] + shares["redundancy"],
                breakdown_share=shares,
                preemptions=mean(r.preemptions for r in results),
                restarts=mean(r.restarts for r in results),
                failovers=mean(r.failovers for r in results),
                saves=mean(r.saves for r in results),
                fatal_failures=mean(r.fatal_failures for r in results),
                steps_done=mean(r.steps_done for r in results),
            )
        )
    return rows


def pct(share: float) -> str:
    """A share as a percentage; rounding noise (-1e-17) prints as 0.0%, never -0.0%."""
    value = round(100 * share, 1)
    return f"{0.0 if value == 0 else value:.1f}%"


def money(dollars: float) -> str:
    """Cents where they matter: a small job's $0.42 must not print as $0."""
    return f"{dollars:,.2f}" if dollars < 100 else f"{dollars:,.0f}"


def notes(
    rows: list[Row], job: JobSpec, model: PreemptionModel, horizon_factor: float = HORIZON_FACTOR
) -> list[str]:
    """What a reader of the table must know: the adaptive policy's starting interval, runs
    cut at the horizon, and redundancy offered where it cannot help."""
    out: list[str] = []
    names = {r.strategy for r in rows}
    if "adaptive" in names:
        tau, mttp = daly_start_interval_s(job, model)
        fits = job.step_s + job.save_s + job.backup_s < model.notice_s
        out.append(
            f"adaptive starts from the Daly-optimal interval sqrt(2·δ·(MTTP+R)) = {tau:,.0f} s "
            f"(δ {job.save_s:g} s, job MTTP {mttp:,.0f} s, R {job.mean_restart_s:g} s); "
            + (
                "the notice fits an emergency save, so it saves on notice instead"
                if fits
                else "the notice is too short for an emergency save, so it saves at this interval"
            )
        )
    if "redundant" in names and job.stages == 1:
        out.append(
            "warning: redundant computation on a 1-stage job: no stage has a shadow, so "
            "every preemption is fatal (restart from the last checkpoint)"
        )
    for r in rows:
        if r.finished < r.runs:
            out.append(
                f"warning: {r.strategy} finished {r.finished}/{r.runs} runs within the horizon "
                f"({horizon_factor:g}x the ideal time); unfinished runs are credited only with "
                f"the steps they trained ({r.steps_done:,.0f} of {job.steps:,} on average)"
            )
    return out


def table(rows: list[Row], title: str) -> Table:
    t = Table(title=title, show_lines=False)
    t.add_column("strategy", style="bold")
    t.add_column("time h", justify="right")
    t.add_column("×ideal", justify="right")
    t.add_column("cost $", justify="right")
    t.add_column("cost ×OD", justify="right")
    t.add_column("samples/$", justify="right")
    t.add_column("value ×OD", justify="right")
    for b in BUCKETS:
        t.add_column(b, justify="right")
    t.add_column("preempt", justify="right")
    t.add_column("restarts", justify="right")
    t.add_column("fatal", justify="right")
    t.add_column("finished", justify="right")
    for r in rows:
        t.add_row(
            r.strategy,
            f"{r.time_h:.2f}",
            f"{r.time_vs_ideal:.3f}",
            money(r.cost),
            f"{r.cost_vs_on_demand:.3f}",
            f"{r.samples_per_dollar:,.1f}",
            f"{r.value_vs_on_demand:.2f}",
            *[pct(r.breakdown_share[b]) for b in BUCKETS],
            f"{r.preemptions:.1f}",
            f"{r.restarts:.1f}",
            f"{r.fatal_failures:.1f}" if r.strategy == "redundant" else "-",
            f"{r.finished}/{r.runs}",
        )
    return t


def render(rows: list[Row], title: str, console: Console | None = None) -> None:
    (console or Console(width=200)).print(table(rows, title))


def markdown(rows: list[Row]) -> str:
    head = (
        "| strategy | time h | ×ideal | cost $ | cost ×OD | samples/$ | value ×OD | "
        + " | ".join(BUCKETS)
        + " | preemptions | restarts | fatal failures | finished |"
    )
    sep = "|" + "---|" * (11 + len(BUCKETS))
    lines = [head, sep]
    for r in rows:
        lines.append(
            f"| {r.strategy} | {r.time_h:.2f} | {r.time_vs_ideal:.3f} | {money(r.cost)} | "
            f"{r.cost_vs_on_demand:.3f} | {r.samples_per_dollar:,.1f} | "
            f"{r.value_vs_on_demand:.2f} | "
            + " | ".join(pct(r.breakdown_share[b]) for b in BUCKETS)
            + f" | {r.preemptions:.1f} | {r.restarts:.1f} | "
            + (f"{r.fatal_failures:.1f}" if r.strategy == "redundant" else "-")
            + f" | {r.finished}/{r.runs} |"
        )
    return "\n".join(lines)
