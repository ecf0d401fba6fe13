"""Platform overhead on the local backend, bare vs through Rhizome, in one run.

1. Throughput: the same CPU training script (a small CNN, one thread, fixed number of
   steps; it times its own training loop) runs bare and as a Rhizome job back to back,
   ROUNDS times, the order flipping every round (ABBA), so that a load spike on a shared
   machine tends to hit one round's pair rather than one side. The figure is the median
   of the rounds' ratios (Rhizome samples/s ÷ bare samples/s) with its 95 % confidence
   interval (order statistics: no assumption on the noise), and a verdict: MET when the
   whole interval is ≥ 0.99, MISSED when all of it is below, else UNRESOLVED.
   Goal ≥ 0.99 (FfDL measured ≈ 0.95, i.e. up to 5 % overhead).
2. Submit-to-PROCESSING latency: trivial jobs submitted one at a time; the figure is the
   median time from the client's submit call to the PROCESSING entry of the job's
   history. Goal < 1 s (FfDL's guardian creation alone took < 3 s).

    .venv/bin/python benchmarks/overhead.py [--rounds 12] [--latency-jobs 5]
"""

from __future__ import annotations

import argparse
import io
import re
import statistics
import subprocess
import sys
import time
import zipfile

from _platform import BenchPlatform
from _stats import median_interval, quartiles, verdict

from services.client.sdk import Client
from services.store.jobs import JobsRepository
from services.store.mongo import connect

TRAIN = r"""
import time, torch
from torch import nn
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                      nn.Linear(16 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 1, 16, 16), torch.randint(0, 10, (64,))
for _ in range(20):
    opt.zero_grad(); nn.functional.cross_entropy(model(x), y).backward(); opt.step()
import sys
steps = int(sys.argv[1])
start = time.perf_counter()
for _ in range(steps):
    opt.zero_grad(); nn.functional.cross_entropy(model(x), y).backward(); opt.step()
print(f"throughput={steps * 64 / (time.perf_counter() - start):.1f}", flush=True)
"""
MANIFEST = "name: {name}\nmemory: 2Gb\nframework:\n  command: {command!r}\n"


def bare(steps: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", TRAIN, str(steps)], capture_output=True, text=True, check=True
    )
    return float(re.search(r"throughput=([\d.]+)", out.stdout).group(1))  # type: ignore[union-attr]


def through(platform: BenchPlatform, client: Client, repo: JobsRepository, steps: int) -> float:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("train.py", TRAIN)
    job_id = client.create_job(
        MANIFEST.format(name="overhead", command=f"python train.py {steps}"), buf.getvalue()
    ).job_id
    wait_end(repo, job_id)
    log = (platform.data_dir / "jobs" / job_id / "learners" / "0" / "stdout.log").read_text()
    return float(re.search(r"throughput=([\d.]+)", log).group(1))  # type: ignore[union-attr]


def wait_end(repo: JobsRepository, job_id: str, timeout_s: float = 300) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = repo.get(job_id).status
        if status in ("COMPLETED", "FAILED", "DELETED", "HALTED"):
            if status != "COMPLETED":
                raise SystemExit(f"job {job_id} ended {status}: {repo.get(job_id).status_message}")
            return status
        time.sleep(0.1)
    raise SystemExit(f"job {job_id} did not end in {timeout_s}s")


def latency(client: Client, repo: JobsRepository) -> float:
    t0 = time.time()
    job_id = client.create_job(MANIFEST.format(name="latency", command="true")).job_id
    wait_end(repo, job_id)
    processing = [h.time for h in repo.get(job_id).history if h.status == "PROCESSING"]
    return processing[0] - t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=12, help="interleaved (ABBA) rounds")
    parser.add_argument("--latency-jobs", type=int, default=5)
    parser.add_argument(
        "--steps", type=int, default=1500, help="timed training steps per run (64 samples each)"
    )
    args = parser.parse_args()
    ratios: list[float] = []  # per round: Rhizome samples/s ÷ bare samples/s
    bare_runs, rz_runs = [], []
    with BenchPlatform() as platform:
        repo = JobsRepository(connect(platform.mongo.url))
        with Client(platform.api, token=platform.token) as client:
            latency(client, repo)  # warm-up: first imports, first index use
            for rnd in range(args.rounds):
                if rnd % 2 == 0:
                    b, r = bare(args.steps), through(platform, client, repo, args.steps)
                else:
                    r, b = through(platform, client, repo, args.steps), bare(args.steps)
                bare_runs.append(b)
                rz_runs.append(r)
                ratios.append(r / b)
                print(f"  round {rnd + 1}/{args.rounds}: ratio {r / b:.3f}", file=sys.stderr)
            lat = [latency(client, repo) for _ in range(args.latency_jobs)]
    low, mid, high = quartiles(ratios)
    ci_low, ci_high = median_interval(ratios)
    # verdict() reads "at most the goal": the slowdown bare ÷ Rhizome against 1 / 0.99.
    met = verdict(1 / ci_high, 1 / ci_low, 1 / 0.99)
    print("| measure | bare | Rhizome (local backend) | figure | goal | FfDL |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(
        f"| training throughput (samples/s, median of {args.rounds} ABBA rounds) "
        f"| {statistics.median(bare_runs):.0f} | {statistics.median(rz_runs):.0f} "
        f"| ratio {mid:.3f} [95 % CI {ci_low:.3f}–{ci_high:.3f}; quartiles {low:.3f}–{high:.3f}] "
        f"{met} | ≥ 0.99 | ≈ 0.95 |"
    )
    print(
        f"| submit → PROCESSING (s, median of {len(lat)}; min {min(lat):.2f}, max {max(lat):.2f}) | – "
        f"| {statistics.median(lat):.2f} | {statistics.median(lat):.2f} s | < 1 s | guardian creation alone < 3 s |"
    )
    print(f"per-round ratios: {[round(v, 3) for v in ratios]}")
    print(
        f"bare runs: {[round(v) for v in bare_runs]}; Rhizome runs: {[round(v) for v in rz_runs]}"
    )


if __name__ == "__main__":
    main()
