"""Throughput (samples/s) of the elastic data-parallel runtime against its number of
workers, p = 1, 2, 3, 4, 6, 8 (issue #19: the throughput-vs-parallelism model of
Elastic-Tiresias taken from measured runs).

Each point is a real run of examples/elastic-regression/train.py: p worker processes on
real etcd, gloo over loopback, started the way benchmarks/elastic_scaling.py starts them
(its ``Run`` helper, imported), with ``--min-workers p`` so that the job forms at p
workers. After a warm-up the committed steps of the workers' sample logs give samples per
second (samples committed / wall time between the first and the last measured step).

**What this measures.** The per-step compute is a fixed stand-in: the example's
``--step-delay`` (a sleep), the same for every p. A sleep takes no CPU, so 8 processes on
this 2-core machine do not compete for cores to "compute"; what grows with p is the
data-parallel runtime's own cost per step — the gloo all-reduce of the gradients and the
step reports, the block hand-out, the offset reports to etcd — plus what those cost in
CPU on 2 shared cores. The model itself (an 8→1 linear layer) is negligible. So the
curve is the runtime's scaling with a step of ``--step-delay`` seconds of compute, not a
GPU model's; with a longer step the same runtime scales better.

Repetitions are interleaved (every p once, then again, in alternating order) and the
median per p is taken. Prints the table, the speedup over p=1 next to the
``CommunicationBound`` model with its overhead fitted by least squares, and with
``--write PATH`` writes the curve as JSON (``load_throughput_curve`` reads it; the
bundled curve is services/scheduler/elasticity/data/elastic_regression_throughput.json).

    .venv/bin/python benchmarks/elastic_throughput.py [--workers 1,2,3,4,6,8] [--reps 3]
        [--step-delay 0.05] [--write PATH]

Stops its workers by SIGTERM and pid only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from elastic_scaling import Run  # noqa: E402

from services.embedded.servers import EtcdServer  # noqa: E402
from services.scheduler.elasticity.api import (  # noqa: E402
    THROUGHPUT_CURVE_FORMAT,
    CommunicationBound,
    fit_overhead,
)


def committed(run: Run) -> dict[int, tuple[float, int, int]]:
    """step -> (earliest time a worker logged it, samples in it, workers in it)."""
    out: dict[int, tuple[float, int, int]] = {}
    for path in run.tmp.glob("log-*.jsonl"):
        for line in path.read_text().splitlines():
            rec: dict[str, Any] = json.loads(line)
            if "samples" not in rec:
                continue
            n = sum(len(ids) for ids in rec["samples"].values())
            old = out.get(rec["step"])
            t = rec["time"] if old is None else min(old[0], rec["time"])
            out[rec["step"]] = (t, n, len(rec["samples"]))
    return out


def measure(etcd: str, tmp: Path, job: str, p: int, args: argparse.Namespace) -> float:
    """Samples/s of one run at p workers, over ``args.steps`` steps after ``args.warmup``."""
    run = Run(etcd, tmp, job, args.step_delay)
    run.tmp.mkdir()
    try:
        for i in range(p):
            run.start(f"w{i}", "--min-workers", str(p))
        deadline = time.monotonic() + args.timeout
        while True:
            steps = sorted(s for s, (_, _, k) in committed(run).items() if k == p)
            if len(steps) >= args.warmup + args.steps + 1:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out: p={p} in {run.tmp}")
            time.sleep(0.1)
    finally:
        run.terminate(*run.procs)
    rows = committed(run)
    window = steps[args.warmup : args.warmup + args.steps + 1]
    # the samples of the steps after the first, over the time from the first to the last
    samples = sum(rows[s][1] for s in window[1:])
    return samples / (rows[window[-1]][0] - rows[window[0]][0])


def host_facts() -> dict[str, Any]:
    import torch

    return {
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backend": "gloo over loopback, one process per worker",
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--workers", default="1,2,3,4,6,8", help="comma-separated p values")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions per p")
    ap.add_argument("--step-delay", type=float, default=0.05, help="compute seconds per step")
    ap.add_argument("--warmup", type=int, default=10, help="steps at p workers not measured")
    ap.add_argument("--steps", type=int, default=60, help="steps measured per run")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run at most")
    ap.add_argument("--write", default=None, help="write the curve as JSON to this path")
    args = ap.parse_args(argv)
    workers = sorted({int(w) for w in args.workers.split(",")})
    if not workers or workers[0] != 1 or args.reps < 1 or args.steps < 2:
        ap.error("--workers must start at 1; --reps >= 1; --steps >= 2")
    facts = host_facts()
    tmp = Path(tempfile.mkdtemp(prefix="elastic-throughput-"))
    etcd = EtcdServer(tmp / "etcd")
    etcd.start()
    runs: dict[int, list[float]] = {p: [] for p in workers}
    try:
        for rep in range(args.reps):
            # alternate the order so that a drift of the machine's load spreads over all p
            for p in workers if rep % 2 == 0 else workers[::-1]:
                rate = measure(etcd.url, tmp / f"r{rep}-p{p}", f"tput-r{rep}-p{p}", p, args)
                runs[p].append(rate)
                print(f"# rep {rep} p={p}: {rate:.1f} samples/s", file=sys.stderr, flush=True)
    finally:
        etcd.stop()
    facts["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    median = {p: statistics.median(v) for p, v in runs.items()}
    speedup = {p: median[p] / median[1] for p in workers}
    overhead = fit_overhead(speedup)
    model = CommunicationBound(overhead)
    print(
        f"# elastic runtime throughput: examples/elastic-regression, batch 8 per worker, "
        f"step compute {args.step_delay:.3f} s (sleep), {args.reps} interleaved reps, "
        f"median; {facts['cpus']} cores"
    )
    print("p | samples/s (median) | runs | speedup | CommunicationBound fit | efficiency")
    for p in workers:
        each = ", ".join(f"{r:.0f}" for r in runs[p])
        print(
            f"{p} | {median[p]:.1f} | {each} | {speedup[p]:.2f} | {model.throughput(p):.2f} | "
            f"{100 * speedup[p] / p:.0f} %"
        )
    print(
        f"CommunicationBound least-squares fit: overhead = {overhead:.4f} (simulator default 0.05)"
    )
    if args.write:
        doc = {
            "format": THROUGHPUT_CURVE_FORMAT,
            "description": (
                "Throughput of Rhizome's elastic data-parallel runtime "
                "(examples/elastic-regression/train.py) against its number of workers; "
                "per-step compute is a fixed sleep, so the curve is the runtime's own "
                "cost (gloo all-reduce over loopback, block hand-out, offset reports)."
            ),
            "command": "benchmarks/elastic_throughput.py "
            + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": facts,
            "workload": {
                "example": "examples/elastic-regression/train.py",
                "batch_size_per_worker": 8,
                "step_delay_s": args.step_delay,
                "warmup_steps": args.warmup,
                "measured_steps": args.steps,
                "reps": args.reps,
            },
            "points": [
                {
                    "learners": p,
                    "samples_per_s": round(median[p], 2),
                    "speedup": round(speedup[p], 4),
                    "runs_samples_per_s": [round(r, 2) for r in runs[p]],
                }
                for p in workers
            ],
            "fitted_overhead": round(overhead, 4),
        }
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"# wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
