"""Reproduce the papers' published experiments with Rhizome's simulators, the paper's
figure beside ours and the ratio, in one run:

- FfDL §5.3: deadlocked learners without gang scheduling, none with it, on 15 nodes ×
  4 GPUs, both as the paper's text describes the workload (50 jobs × 2 learners × 1 GPU)
  and with the mixed shapes the repo's `ffdl-gang` uses by default.
- FfDL §5.2: jobs queued over 15 minutes, SPREAD vs PACK, 400 GPUs (a synthetic day:
  IBM's trace is not public).
- Bamboo: value (samples per dollar, relative to on-demand) against the per-node,
  per-hour preemption probability, for redundant computation vs checkpoint-restart
  vs adaptive, on Bamboo's GPT-2 shape (64 nodes); and its anchors on the p3 trace.
- Spotify (thesis): the adaptive interval against fixed intervals, and the cost/latency
  anchor (GPT-117M, MTTP 3 h).

    .venv/bin/python benchmarks/reproduce.py [--runs N] [--markdown FILE]

The papers' figures are the ones the project's sources quote (docs/, benchmarks/RESULTS.md);
where a paper gives no number for a point, the table says so instead of inventing one.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spot_strategies import GPT2, GPT117M

from services.scheduler.sim.cli import gang_experiment, pack_experiment
from services.sim import traces
from services.sim.cli import INSTANCE_PRICES, mttp_from_hourly_probability
from services.sim.model import PreemptionModel, Prices
from services.sim.runner import Row, simulate
from services.sim.strategies import RedundancyParams, factories

FIXED_S = [300.0, 900.0, 1800.0, 3600.0]
SPOTIFY_FIXED_S = [300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0]
PROBABILITIES = [0.01, 0.02, 0.05, 0.1, 0.2]


@dataclass
class Claim:
    experiment: str
    measure: str
    paper: float | None  # None: the paper gives no number for this point
    ours: float
    unit: str
    why: str

    def cells(self) -> list[str]:
        ratio = (
            f"{self.ours / self.paper:.2f}"
            if self.paper not in (None, 0)
            else ("equal" if self.paper == self.ours else "–")
        )
        paper = "no figure" if self.paper is None else f"{self.paper:g}{self.unit}"
        ours = f"{self.ours:.3g}{self.unit}" if self.unit else f"{self.ours:.3f}"
        return [self.experiment, self.measure, paper, ours, ratio]


def _row(rows: list[Row], name: str) -> Row:
    return next(r for r in rows if r.strategy == name)


def _best_fixed(rows: list[Row]) -> Row:
    fixed = [r for r in rows if r.strategy.startswith("checkpoint-restart")]
    # by value, so a fixed interval that never finishes (value ~0) is never "best"
    return max(fixed, key=lambda r: r.samples_per_dollar)


def ffdl_gang(runs: int) -> tuple[list[Claim], list[str]]:
    claims: list[Claim] = []
    lines = ["### FfDL §5.3: per-pod vs gang scheduling (15 nodes × 4 K80)", ""]
    lines += [
        "| workload | policy | runs with deadlock | max deadlocked learners | max idle GPUs % "
        "| max learners waiting for siblings | permanent deadlocks |",
        "|---|---|---|---|---|---|---|",
    ]
    variants = [
        ("paper's text: 50 jobs 2×1", 50, [(2, 1)]),
        ("repo default: 50 each of 2×1, 2×2, 4×1", 50, [(2, 1), (2, 2), (4, 1)]),
    ]
    for label, per_shape, shapes in variants:
        out = gang_experiment(runs, 0, per_shape, 0.5, 5.0, shapes=shapes)
        for s in out["summary"]:
            lines.append(
                f"| {label} | {s['policy']} | {s['runs_with_deadlocked_learners']}/{s['runs']} "
                f"| {s['deadlocked_learners_max']} | {s['idle_gpu_pct_max']} "
                f"| {s['waiting_for_siblings_max']} | {s['permanent_deadlocks']} |"
            )
        by = {s["policy"]: s for s in out["summary"]}
        why = (
            "our per-pod baseline's pod timing (0.5 s deploy gap, 5 s pod spread) is a model "
            "of FfDL's LCM, not a measurement; the share of runs follows it"
        )
        claims += [
            Claim(
                f"FfDL §5.3, {label}",
                "per-pod: runs with deadlocked learners",
                60,
                by["per-pod"]["runs_with_deadlock_pct"],
                " %",
                why,
            ),
            Claim(
                f"FfDL §5.3, {label}",
                "per-pod: most GPUs held idle",
                46,
                by["per-pod"]["idle_gpu_pct_max"],
                " %",
                "a deadlock here holds what the interleaving leaves; FfDL's trace timing "
                "is not published",
            ),
            Claim(
                f"FfDL §5.3, {label}",
                "gang (PACK): runs with deadlocked learners",
                0,
                by["pack"]["runs_with_deadlock_pct"],
                " %",
                "same as the paper: a gang is placed whole or not at all",
            ),
        ]
    return claims, lines


def ffdl_pack(days: int) -> tuple[list[Claim], list[str]]:
    out = pack_experiment(days, 0, 24.0, 0.9, False)
    lines = ["### FfDL §5.2 shape: 400 GPUs, synthetic day(s) at 90 % offered load", ""]
    lines += [
        "| policy | jobs | queued > 15 min | utilization % | mean JCT min |",
        "|---|---|---|---|---|",
    ]
    for s in out["summary"]:
        lines.append(
            f"| {s['policy']} | {s['jobs']} | {s['queued_over_15min']} | "
            f"{s['utilization_pct']} | {s['jct_mean_min']} |"
        )
    ratio = out["spread_over_pack_queued_over_15min"] or 0.0
    claim = Claim(
        "FfDL §5.2 shape",
        "SPREAD / PACK jobs queued over 15 min",
        3,
        ratio,
        "×",
        "the paper says 'more than 3×' on IBM's production trace, which is not public; "
        "ours is a synthetic day with the paper's cluster shape, so only the direction "
        "and rough size compare",
    )
    return [claim], lines


def bamboo(runs: int) -> tuple[list[Claim], list[str]]:
    prices = Prices(*INSTANCE_PRICES["p3.2xlarge"])
    redundancy = RedundancyParams()
    names = ["on-demand", "checkpoint-restart", "adaptive", "redundant"]
    lines = [
        "### Bamboo: value against the per-hour preemption probability (GPT-2, 64 nodes, "
        "120 s notice)",
        "",
        "Value is samples per dollar relative to on-demand (1.00 = on-demand's value); "
        "finished is runs finished out of runs (an unfinished run counts only the steps it kept). "
        "Bamboo plots this sweep, but its per-probability values are not in this project's "
        "sources, so there is no paper column here: compare the shape (redundancy's lead "
        "grows with the probability), not the numbers.",
        "",
        "| p per node-hour | job preemptions/h | redundant value | finished | best fixed "
        "interval | its value | finished | adaptive value | finished | redundant / best fixed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in PROBABILITIES:
        model = PreemptionModel(notice_s=120.0, mttp_node_s=mttp_from_hourly_probability(p))
        rows = simulate(
            GPT2,
            model,
            prices,
            factories(names, intervals_s=FIXED_S, redundancy=redundancy),
            runs=runs,
        )
        red, ada, best = _row(rows, "redundant"), _row(rows, "adaptive"), _best_fixed(rows)
        rel = red.value_vs_on_demand / best.value_vs_on_demand if best.value_vs_on_demand else 0
        lines.append(
            f"| {p:g} | {model.job_rate_hr(GPT2.nodes):.1f} | {red.value_vs_on_demand:.2f} "
            f"| {red.finished}/{red.runs} | {best.strategy.split('/')[1]} "
            f"| {best.value_vs_on_demand:.2f} | {best.finished}/{best.runs} "
            f"| {ada.value_vs_on_demand:.2f} | {ada.finished}/{ada.runs} | {rel:.2f} |"
        )
    # The anchors, on the real trace the paper's numbers come from.
    model = PreemptionModel(notice_s=120.0, trace=traces.load("aws-p3-64.csv"))
    rows = simulate(
        GPT2, model, prices, factories(names, intervals_s=FIXED_S, redundancy=redundancy), runs=runs
    )
    od, red, best = _row(rows, "on-demand"), _row(rows, "redundant"), _best_fixed(rows)
    lines += [
        "",
        f"On the p3 trace ({model.job_rate_hr(GPT2.nodes):.1f} preemptions/h hit the job): "
        f"redundant trains {100 * red.in_training_share:.0f} % of its time, the best fixed "
        f"interval ({best.strategy}) {100 * best.in_training_share:.0f} %.",
    ]
    bulk = (
        "the p3 trace removes nodes in bulk, so consecutive stages are often lost together, "
        "which is fatal in Bamboo's design too; Bamboo's 84 % comes from its own runs, whose "
        "failover and reconfiguration times we assume (10 s, 30 s) rather than measure"
    )
    claims = [
        Claim(
            "Bamboo, p3 trace",
            "redundant: share of time training",
            84,
            100 * red.in_training_share,
            " %",
            bulk,
        ),
        Claim(
            "Bamboo, p3 trace",
            "checkpoint-restart: share of time training",
            23,
            100 * best.in_training_share,
            " %",
            "ours is the best of 5m/15m/30m/1h; the paper's interval is not in our sources",
        ),
        Claim(
            "Bamboo, p3 trace",
            "redundant vs checkpoint-restart throughput",
            3.7,
            best.time_h / red.time_h,
            "×",
            "throughput = steps / wall time; the bulk removals of the p3 trace and the "
            "assumed failover and reconfiguration times, as for the share of time training",
        ),
        Claim(
            "Bamboo, p3 trace",
            "on-demand cost / redundant cost",
            2.4,
            od.cost / red.cost,
            "×",
            "our spot price is 30 % of on-demand, a default (services/sim/cli.py), not the "
            "price Bamboo paid",
        ),
    ]
    return claims, lines


def spotify(runs: int) -> tuple[list[Claim], list[str]]:
    prices = Prices(*INSTANCE_PRICES["p3.2xlarge"])
    redundancy = RedundancyParams()
    lines = [
        "### Spotify: adaptive vs fixed checkpoint intervals (GPT-117M, 1 node, MTTP 3 h)",
        "",
        "| notice | interval | time h | ×ideal | recompute % | saves | finished |",
        "|---|---|---|---|---|---|---|",
    ]
    claims: list[Claim] = []
    for notice in (120.0, 0.0):
        model = PreemptionModel(notice_s=notice, mttp_node_s=3 * 3600.0)
        rows = simulate(
            GPT117M,
            model,
            prices,
            factories(
                ["on-demand", "checkpoint-restart", "adaptive"],
                intervals_s=SPOTIFY_FIXED_S,
                redundancy=redundancy,
            ),
            runs=runs,
        )
        for r in rows[1:]:
            lines.append(
                f"| {notice:g} s | {r.strategy} | {r.time_h:.2f} | {r.time_vs_ideal:.3f} | "
                f"{100 * r.breakdown_share['recompute']:.1f} | {r.saves:.1f} | "
                f"{r.finished}/{r.runs} |"
            )
        od, ada = _row(rows, "on-demand"), _row(rows, "adaptive")
        fixed = [r for r in rows if r.strategy.startswith("checkpoint-restart")]
        best = min(fixed, key=lambda r: r.time_h)
        if notice:
            claims += [
                Claim(
                    "Spotify, 120 s notice",
                    "adaptive: cost cut vs on-demand",
                    62,
                    100 * (1 - ada.cost / od.cost),
                    " %",
                    "our spot price is 30 % of on-demand; the thesis' price ratio is not in "
                    "our sources",
                ),
                Claim(
                    "Spotify, 120 s notice",
                    "adaptive: extra time vs on-demand",
                    2.86,
                    100 * (ada.time_h / od.time_h - 1),
                    " %",
                    "our restart (allocation 60–300 s + preparation 60–180 s) is slower than "
                    "the thesis' testbed",
                ),
            ]
        claims.append(
            Claim(
                f"Spotify, {notice:g} s notice",
                "adaptive time / best fixed interval time",
                None,
                ada.time_h / best.time_h,
                "",
                "the thesis compares against fixed intervals but its per-interval numbers are "
                "not in our sources; < 1 means adaptive is faster",
            )
        )
    return claims, lines


def _reasons(claims: list[Claim]) -> list[str]:
    """One line per distinct reason, naming every measure it explains."""
    by_why: dict[str, list[str]] = {}
    for c in claims:
        by_why.setdefault(c.why, []).append(f"{c.experiment}: {c.measure}")
    return [f"- {'; '.join(measures)} — {why}" for why, measures in by_why.items()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="seeded runs per spot strategy")
    ap.add_argument("--gang-runs", type=int, default=20, help="seeds for FfDL §5.3")
    ap.add_argument("--days", type=int, default=1, help="synthetic days for FfDL §5.2")
    ap.add_argument("--markdown", type=Path, help="also write the report here")
    args = ap.parse_args()
    if min(args.runs, args.gang_runs, args.days) < 1:
        ap.error("--runs, --gang-runs and --days must be >= 1")
    t0 = time.time()
    claims: list[Claim] = []
    details: list[str] = []
    for name, step in (
        ("FfDL §5.3", lambda: ffdl_gang(args.gang_runs)),
        ("FfDL §5.2", lambda: ffdl_pack(args.days)),
        ("Bamboo", lambda: bamboo(args.runs)),
        ("Spotify", lambda: spotify(args.runs)),
    ):
        print(f"running {name} ...", file=sys.stderr, flush=True)
        c, lines = step()
        claims += c
        details += [*lines, ""]
    report = [
        "| experiment | measure | paper | ours | ours / paper |",
        "|---|---|---|---|---|",
        *("| " + " | ".join(c.cells()) + " |" for c in claims),
        "",
        "Where and why they differ:",
        "",
        *_reasons(claims),
        "",
        *details,
        f"reproduction took {time.time() - t0:.0f} s",
    ]
    text = "\n".join(report) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
