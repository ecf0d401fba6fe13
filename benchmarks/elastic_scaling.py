"""Stall of an elastic scale-out (2 -> 4 workers) and scale-in (4 -> 2) against
stop-resume of the same job (every worker saves and exits, then 4 fresh processes load
the checkpoint), in one run, on real etcd and real worker processes
(examples/elastic-regression/train.py, gloo).

Stall = the wall time between the last step before the change and the first step after
it, minus one ordinary step (the median step interval before the change); in
iterations = stall / that median. The joiners' preparation (process start, imports,
model and data) is not stall for elastic scaling (the others train meanwhile); for
stop-resume it is. Amoeba: scale-out ~1.1 s, scale-in no noticeable stall, stop-resume
tens of seconds. Goal (issue #19): scale-out < 0.5 s and <= 1 iteration.

Stops by SIGTERM and pid only. Not a platform run yet: `rhizome scale` is not built.

    .venv/bin/python benchmarks/elastic_scaling.py [--step-delay 0.05]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.embedded.servers import EtcdServer  # noqa: E402

EXAMPLE = ROOT / "examples" / "elastic-regression" / "train.py"


class Run:
    def __init__(self, etcd: str, tmp: Path, job: str, step_delay: float) -> None:
        self.etcd, self.tmp, self.job, self.step_delay = etcd, tmp, job, step_delay
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, worker: str, *extra: str) -> None:
        argv = [
            sys.executable, str(EXAMPLE), "--job", self.job, "--etcd", self.etcd,
            "--worker", worker, "--epochs", "1000", "--samples", "4096", "--batch-size", "8",
            "--step-delay", str(self.step_delay), "--sample-log", str(self.tmp / f"log-{worker}.jsonl"),
            *extra,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        out = (self.tmp / f"{self.job}-{worker}.out").open("wb")
        self.procs[worker] = subprocess.Popen(
            argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env
        )

    def times(self) -> dict[int, float]:
        """step -> the earliest time a worker logged it committed."""
        out: dict[int, float] = {}
        for path in self.tmp.glob("log-*.jsonl"):
            for line in path.read_text().splitlines():
                rec: dict[str, Any] = json.loads(line)
                if "samples" in rec:
                    out[rec["step"]] = min(out.get(rec["step"], rec["time"]), rec["time"])
        return out

    def wait_steps(self, n: int, timeout: float = 300) -> int:
        deadline = time.monotonic() + timeout
        while (steps := max(self.times(), default=-1) + 1) < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for step {n} of {self.job}; see {self.tmp}")
            time.sleep(0.05)
        return steps

    def sizes(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for path in self.tmp.glob("log-*.jsonl"):
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                if "samples" in rec:
                    out[rec["step"]] = len(rec["samples"])
        return out

    def terminate(self, *workers: str) -> None:
        for w in workers:
            os.kill(self.procs[w].pid, signal.SIGTERM)
        for w in workers:
            self.procs[w].wait(120)


def stall(times: dict[int, float], last_before: int) -> tuple[float, float]:
    """(seconds, iterations) lost between step `last_before` and the next one."""
    steps = sorted(s for s in times if s <= last_before)[-10:]
    median = statistics.median(times[b] - times[a] for a, b in itertools.pairwise(steps))
    gap = times[last_before + 1] - times[last_before] - median
    return gap, gap / median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-delay", type=float, default=0.05, help="compute seconds per step")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="elastic-bench-"))
    etcd = EtcdServer(tmp / "etcd")
    etcd.start()
    try:
        el = Run(etcd.url, tmp / "elastic", "elastic", args.step_delay)
        el.tmp.mkdir()
        for w in ("w0", "w1"):
            el.start(w, "--min-workers", "2")
        at_two = el.wait_steps(20)
        for w in ("w2", "w3"):
            el.start(w)
        while 4 not in el.sizes().values():
            time.sleep(0.05)
        sizes = el.sizes()
        first_four = min(s for s, n in sizes.items() if n == 4)
        el.wait_steps(first_four + 20)
        el.terminate("w2", "w3")
        sizes = el.sizes()
        first_two = min(s for s, n in sizes.items() if n == 2 and s > first_four)
        el.wait_steps(first_two + 12)
        el.terminate("w0", "w1")
        times = el.times()
        out_s, out_it = stall(times, first_four - 1)
        in_s, in_it = stall(times, first_two - 1)
        del at_two

        sr = Run(etcd.url, tmp / "stop-resume", "stop-resume", args.step_delay)
        sr.tmp.mkdir()
        ckpt = sr.tmp / "ckpt.pt"
        for w in ("w0", "w1"):
            sr.start(w, "--min-workers", "2", "--checkpoint", str(ckpt))
        sr.wait_steps(20)
        sr.terminate("w0", "w1")  # both save on leaving (the later one wins: same state)
        last = max(sr.times())
        sr2 = Run(etcd.url, sr.tmp, "stop-resume-2", args.step_delay)
        for w in ("r0", "r1", "r2", "r3"):
            sr2.start(w, "--min-workers", "4", "--checkpoint", str(ckpt))
        sr2.wait_steps(last + 12)
        sr2.terminate("r0", "r1", "r2", "r3")
        sr_s, sr_it = stall(sr2.times(), last)

        print(f"step compute {args.step_delay:.3f} s; shared 2-core machine")
        print(f"elastic scale-out 2->4 stall: {out_s:.3f} s = {out_it:.2f} iterations")
        print(f"elastic scale-in  4->2 stall: {in_s:.3f} s = {in_it:.2f} iterations")
        print(f"stop-resume 2->4 stall:       {sr_s:.3f} s = {sr_it:.2f} iterations")
        print(f"stop-resume / elastic scale-out: {sr_s / max(out_s, 1e-3):.1f}x")
    finally:
        etcd.stop()


if __name__ == "__main__":
    main()
