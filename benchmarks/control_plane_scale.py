"""The control plane with N jobs alive at once: what each job costs and what breaks first.

For each N, a fresh platform (real etcd, MongoDB-wire server, `rhizomed` hosting api,
scheduler and lcm) runs with the simulated backend (services/backends/simulated): every
job goes through the real API, scheduler, LCM, guardian, etcd and MongoDB, but its
learners are threads that write their status keys and log lines and train nothing. The
script submits N one-learner jobs from 8 clients, waits until all N are PROCESSING at
once, holds them there for a steady window, then releases them all together and waits
for all N to be COMPLETED. It reports, per N:

- submit → PROCESSING p50/p99 (from each job's history) and the time for all N;
- the daemon's RSS and CPU; the guardians' count, RSS and CPU; per job, and the CPU per
  job per second of the steady window (the cost of merely keeping a job alive);
- etcd keys and MongoDB documents per job while all are alive;
- release → COMPLETED p50/p99 (status-change latency) and whether any job missed its
  COMPLETED (a lost status change);
- cost per job at the largest N against the smallest (goal: ≤ 1.2x), and the memory a
  10,000-job run would need at the measured cost per job against this machine's memory:
  what breaks first.

    .venv/bin/python benchmarks/control_plane_scale.py [--sizes 10,25,50] [--steady 10]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _load import percentile
from _platform import BenchPlatform

from contract.etcd import EtcdClient
from services.client.sdk import Client
from services.store import states
from services.store.jobs import JobsRepository
from services.store.mongo import connect

CLIENTS = 8
CLUSTER = """nodes:
  - name: sim
    count: 4
    cpus: 100000
    memory_mb: 100000000
    zone: sim-a
"""


def manifest(n: int, until: Path) -> str:
    return (
        f"name: scale-{n}\nlearners: 1\ncpus: 1\nmemory: 16MiB\n"
        "framework:\n  command: 'simulated'\n"
        f"env:\n  SIM_SECONDS: '1'\n  SIM_LOG_LINES: '5'\n  SIM_UNTIL_FILE: '{until}'\n"
    )


def proc_stat(pid: int) -> tuple[float, float]:
    """(RSS in MiB, CPU seconds used so far) of a live process; (0, 0) once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20, cpu


def guardian_pids(data_dir: Path) -> list[int]:
    """The guardians this platform started (their command line names its data dir)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"services.guardian" in cmd and f"--data-dir={data_dir}".encode() in cmd:
            found.append(int(entry.name))
    return found


def sample(daemon_pid: int, data_dir: Path) -> dict[str, float]:
    rss, cpu = proc_stat(daemon_pid)
    guardians = guardian_pids(data_dir)
    g = [proc_stat(p) for p in guardians]
    return {
        "daemon_rss": rss,
        "daemon_cpu": cpu,
        "guardians": len(guardians),
        "guardian_rss": sum(r for r, _ in g),
        "guardian_cpu": sum(c for _, c in g),
    }


def wait_all(repo: JobsRepository, ids: list[str], status: str, timeout_s: float) -> float:
    start = time.monotonic()
    pending = set(ids)
    while pending:
        if time.monotonic() - start > timeout_s:
            raise SystemExit(f"{len(pending)} of {len(ids)} jobs never reached {status}")
        pending = {j for j in pending if repo.get(j).status != status}
        time.sleep(0.5)
    return time.monotonic() - start


def entered(repo: JobsRepository, job_id: str, status: str) -> float:
    return next(h.time for h in repo.get(job_id).history if h.status == status)


def run(n: int, steady_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rz-scale-") as tmp:
        cluster = Path(tmp) / "cluster.yaml"
        cluster.write_text(CLUSTER)
        release = Path(tmp) / "release"
        args = ["--backend=simulated", f"--cluster-config={cluster}"]
        with BenchPlatform(services="api,scheduler,lcm", daemon_args=args) as platform:
            assert platform.daemon is not None and platform.daemon.pid is not None
            pid = platform.daemon.pid
            db = connect(platform.mongo.url)
            repo = JobsRepository(db)
            before = sample(pid, platform.data_dir)
            ids: list[str] = []
            lock = threading.Lock()

            def submit(worker: int) -> None:
                with Client(platform.api, token=platform.token, tls=False) as rz:
                    for i in range(worker, n, CLIENTS):
                        job_id = rz.create_job(manifest(i, release)).job_id
                        with lock:
                            ids.append(job_id)

            t0 = time.monotonic()
            threads = [threading.Thread(target=submit, args=(w,)) for w in range(CLIENTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wait_all(repo, ids, states.PROCESSING, 120 + n * 2.0)
            all_processing_s = time.monotonic() - t0
            to_processing = [
                entered(repo, j, states.PROCESSING) - repo.get(j).created_at for j in ids
            ]
            # Steady state: N jobs alive, nothing changing.
            s0 = sample(pid, platform.data_dir)
            time.sleep(steady_s)
            s1 = sample(pid, platform.data_dir)
            etcd = EtcdClient(platform.etcd.url)
            etcd_keys = sum(1 for _ in etcd.raw.get_all())
            mongo_docs = sum(db[c].count_documents({}) for c in db.list_collection_names())
            released = time.time()
            release.touch()
            all_done = wait_all(repo, ids, states.COMPLETED, 120 + n * 2.0)
            after = sample(pid, platform.data_dir)
            to_completed = [entered(repo, j, states.COMPLETED) - released for j in ids]
            lost = [j for j in ids if repo.get(j).status != states.COMPLETED]
            db.client.close()
            # Guardians end with their jobs; any left are ours to stop.
            for gpid in guardian_pids(platform.data_dir):
                os.kill(gpid, signal.SIGTERM)
    steady_daemon = s1["daemon_cpu"] - s0["daemon_cpu"]
    steady_guardians = s1["guardian_cpu"] - s0["guardian_cpu"]
    return {
        "n": n,
        "submit_to_processing_p50_s": statistics.median(to_processing),
        "submit_to_processing_p99_s": percentile(to_processing, 0.99),
        "all_processing_s": all_processing_s,
        "daemon_rss_mib": s1["daemon_rss"],
        "daemon_rss_per_job_mib": (s1["daemon_rss"] - before["daemon_rss"]) / n,
        "daemon_cpu_per_job_s": (after["daemon_cpu"] - before["daemon_cpu"]) / n,
        "guardians_alive": s1["guardians"],
        "guardian_rss_per_job_mib": s1["guardian_rss"] / n,
        "guardian_cpu_per_job_s": (s1["guardian_cpu"]) / n,
        "steady_daemon_ms_per_job_s": steady_daemon / n / steady_s * 1000,
        "steady_guardian_ms_per_job_s": steady_guardians / n / steady_s * 1000,
        "etcd_keys_per_job": etcd_keys / n,
        "mongo_docs_per_job": mongo_docs / n,
        "release_to_completed_p50_s": statistics.median(to_completed),
        "release_to_completed_p99_s": percentile(to_completed, 0.99),
        "all_completed_s": all_done,
        "lost_status_changes": len(lost),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="10,25,50", help="N, comma-separated")
    parser.add_argument("--steady", type=float, default=10.0, help="steady window, seconds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [run(int(n), args.steady) for n in args.sizes.split(",")]
    print(f"\n{os.cpu_count()} cores, shared; simulated learners (train nothing)\n")
    cols = [
        ("N", "n", "{:.0f}"),
        ("submit→PROC p50 s", "submit_to_processing_p50_s", "{:.2f}"),
        ("p99 s", "submit_to_processing_p99_s", "{:.2f}"),
        ("daemon RSS MiB", "daemon_rss_mib", "{:.0f}"),
        ("daemon MiB/job", "daemon_rss_per_job_mib", "{:.2f}"),
        ("daemon CPU s/job", "daemon_cpu_per_job_s", "{:.3f}"),
        ("guardian MiB/job", "guardian_rss_per_job_mib", "{:.1f}"),
        ("guardian CPU s/job", "guardian_cpu_per_job_s", "{:.2f}"),
        ("steady daemon ms/job/s", "steady_daemon_ms_per_job_s", "{:.2f}"),
        ("steady guardian ms/job/s", "steady_guardian_ms_per_job_s", "{:.2f}"),
        ("etcd keys/job", "etcd_keys_per_job", "{:.1f}"),
        ("mongo docs/job", "mongo_docs_per_job", "{:.2f}"),
        ("release→COMPLETED p99 s", "release_to_completed_p99_s", "{:.2f}"),
        ("lost", "lost_status_changes", "{:.0f}"),
    ]
    print(" | ".join(c for c, _, _ in cols))
    for row in rows:
        print(" | ".join(fmt.format(row[key]) for _, key, fmt in cols))
    small, large = rows[0], rows[-1]

    cpu_ratio = (large["daemon_cpu_per_job_s"] + large["guardian_cpu_per_job_s"]) / (
        small["daemon_cpu_per_job_s"] + small["guardian_cpu_per_job_s"]
    )
    mem_per_job = large["guardian_rss_per_job_mib"] + large["daemon_rss_per_job_mib"]
    total_mib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20
    print(
        f"\nCPU per job at N={large['n']} vs N={small['n']}: {cpu_ratio:.2f}x "
        f"(goal <= 1.2x: {'met' if cpu_ratio <= 1.2 else 'NOT met'})"
    )
    print(
        f"memory per alive job: {mem_per_job:.1f} MiB -> 10,000 jobs need "
        f"{mem_per_job * 10_000 / 1024:.0f} GiB; this machine has {total_mib / 1024:.0f} GiB, "
        f"so it holds about {total_mib / mem_per_job:.0f} jobs alive (what breaks first)"
    )
    lost = sum(r["lost_status_changes"] for r in rows)
    print(f"lost status changes: {lost}")
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
