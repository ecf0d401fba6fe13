"""Tiresias vs Elastic-Tiresias in the scheduler simulator, same trace, same cluster, one run
(issue #19; Amoeba §6 reports a 29.8 % lower mean JCT on a production trace).

Runs the comparison twice in the same run, on the same traces: under the throughput
model measured on Rhizome's elastic runtime (the headline; the bundled curve of
benchmarks/elastic_throughput.py, or ``--throughput-curve``) and under
``p / (1 + overhead (p - 1))`` with a chosen ``--overhead``. For each it prints, per seed
and as the mean over seeds: JCT mean and p99, utilisation (GPU-time held / cluster
GPU-time until the last job ends), makespan, rescales and preemptions; then the mean JCT
per requested size (Amoeba's Table 2 shape) and the reductions; last, the two
reductions side by side.

    .venv/bin/python benchmarks/elastic_tiresias.py            # 3 seeds, 480 jobs, 64 GPUs
    .venv/bin/python benchmarks/elastic_tiresias.py --seeds 1 --jobs 200 --json

One model at a time is `rhizome-sim elastic [--throughput measured|comm-bound]`. The
simulator, its trace and the models are described in services/scheduler/sim/elastic.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.scheduler.sim.elastic import COMM_BOUND, MEASURED, compare, format_compare


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=480)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--load", type=float, default=1.0, help="offered load of the trace")
    ap.add_argument("--overhead", type=float, default=0.05, help="the comm-bound model's overhead")
    ap.add_argument(
        "--throughput-curve", default=None, help="measured curve file (default: the bundled one)"
    )
    ap.add_argument("--pending-threshold", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.seeds < 1 or args.jobs < 1 or args.gpus < 1 or not args.load > 0:
        ap.error("--seeds, --jobs, --gpus must be >= 1 and --load > 0")
    started = time.perf_counter()
    outs = {
        model: compare(
            args.seeds,
            args.jobs,
            args.gpus,
            args.load,
            args.overhead,
            args.pending_threshold,
            throughput=model,
            curve=args.throughput_curve,
        )
        for model in (MEASURED, COMM_BOUND)
    }
    if args.json:
        print(json.dumps(outs))
        return 0
    for out in outs.values():
        for line in format_compare(out):
            print(line)
        print()
    print("Elastic-Tiresias vs Tiresias, mean JCT reduction (goal >= 29.8 %, Amoeba):")
    for model, out in outs.items():
        verdict = "meets" if out["jct_mean_reduction_pct"] >= 29.8 else "misses"
        print(
            f"  {model:10s} {out['jct_mean_reduction_pct']:.1f} % lower mean, "
            f"{out['jct_p99_reduction_pct']:.1f} % lower p99 ({verdict} the goal); "
            f"model {out['settings']['throughput_model']}"
        )
    print(f"# {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
