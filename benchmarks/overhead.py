"""Platform overhead on the local backend, bare vs through Rhizome, in one run.

1. Throughput: the same CPU training script (a small CNN, one thread, fixed number of
   steps; it times its own training loop) runs bare and as a Rhizome job, alternately,
   REPS times each; the figure is median(Rhizome samples/s) / median(bare samples/s).
   Goal ≥ 0.99 (FfDL measured ≈ 0.95, i.e. up to 5 % overhead).
2. Submit-to-PROCESSING latency: trivial jobs submitted one at a time; the figure is the
   median time from the client's submit call to the PROCESSING entry of the job's
   history. Goal < 1 s (FfDL's guardian creation alone took < 3 s).

    .venv/bin/python benchmarks/overhead.py [--reps 3] [--latency-jobs 5]
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
steps = 400
start = time.perf_counter()
for _ in range(steps):
    opt.zero_grad(); nn.functional.cross_entropy(model(x), y).backward(); opt.step()
print(f"throughput={steps * 64 / (time.perf_counter() - start):.1f}", flush=True)
"""
MANIFEST = "name: {name}\nmemory: 2Gb\nframework:\n  command: {command!r}\n"


def bare() -> float:
    out = subprocess.run([sys.executable, "-c", TRAIN], capture_output=True, text=True, check=True)
    return float(re.search(r"throughput=([\d.]+)", out.stdout).group(1))  # type: ignore[union-attr]


def through(platform: BenchPlatform, client: Client, repo: JobsRepository) -> float:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("train.py", TRAIN)
    job_id = client.create_job(
        MANIFEST.format(name="overhead", command="python train.py"), buf.getvalue()
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
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--latency-jobs", type=int, default=5)
    args = parser.parse_args()
    with BenchPlatform() as platform:
        repo = JobsRepository(connect(platform.mongo.url))
        with Client(platform.api, token=platform.token) as client:
            latency(client, repo)  # warm-up: first imports, first index use
            bare_runs, rz_runs = [], []
            for _ in range(args.reps):
                bare_runs.append(bare())
                rz_runs.append(through(platform, client, repo))
            lat = [latency(client, repo) for _ in range(args.latency_jobs)]
    ratio = statistics.median(rz_runs) / statistics.median(bare_runs)
    print("| measure | bare | Rhizome (local backend) | figure | goal | FfDL |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(
        f"| training throughput (samples/s, median of {args.reps}) | {statistics.median(bare_runs):.0f} "
        f"| {statistics.median(rz_runs):.0f} | ratio {ratio:.3f} | ≥ 0.99 | ≈ 0.95 |"
    )
    print(
        f"| submit → PROCESSING (s, median of {len(lat)}; min {min(lat):.2f}, max {max(lat):.2f}) | – "
        f"| {statistics.median(lat):.2f} | {statistics.median(lat):.2f} s | < 1 s | guardian creation alone < 3 s |"
    )
    print(
        f"bare runs: {[round(v) for v in bare_runs]}; Rhizome runs: {[round(v) for v in rz_runs]}"
    )


if __name__ == "__main__":
    main()
