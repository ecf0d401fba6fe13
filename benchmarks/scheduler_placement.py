"""Placement latency and packing quality of BSA (PACK) vs first-fit and the exact optimum.

For gangs of 8 and 64 learners (1 GPU each) on 100, 1,000 and 10,000 nodes of 8 GPUs,
each repetition draws a fresh fragmented cluster (every node 1-8 GPUs busy, uniform:
no node is empty, so the gang must be assembled from partial nodes),
then times one placement decision by each policy and compares the PACK cost
(services/scheduler/placement/objective.py: nodes used + leftover on them) with the
exact optimum from dynamic programming. Goals (issue #4): p99 < 10 ms at 1,000 nodes,
< 100 ms at 10,000; within 2 % of optimal packing.

    .venv/bin/python benchmarks/scheduler_placement.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from services.scheduler.api import JobRequest
from services.scheduler.cluster import Cluster, Node
from services.scheduler.placement import get_policy


def fragmented(n_nodes: int, rng: np.random.Generator, gpus: int = 8) -> Cluster:
    cluster = Cluster(
        [
            Node(f"n{i}", cpus=64, memory_mb=512_000, gpus=gpus, gpu_type="V100")
            for i in range(n_nodes)
        ]
    )
    # The policies read only the free-resource arrays; set them directly for speed.
    # No node is left empty: a gang must be assembled from partly used nodes (the hard case).
    cluster.gpus_free[:] = gpus - rng.integers(1, gpus + 1, size=n_nodes)
    return cluster


def run(sizes: list[int], gangs: list[int], reps: dict[int, int]) -> list[dict[str, object]]:
    policies = {name: get_policy(name) for name in ("pack", "first-fit", "exact")}
    rows = []
    for n_nodes in sizes:
        for learners in gangs:
            rng = np.random.default_rng([n_nodes, learners])
            times: dict[str, list[float]] = {k: [] for k in policies}
            costs: dict[str, list[float]] = {k: [] for k in policies}
            for rep in range(reps[n_nodes]):
                cluster = fragmented(n_nodes, rng)
                job = JobRequest(f"g{rep}", learners=learners, gpus=1, gpu_type="V100")
                for name, policy in policies.items():
                    t0 = time.perf_counter()
                    a = policy.place(cluster, job, np.random.default_rng(rep))
                    times[name].append(time.perf_counter() - t0)
                    assert a is not None
                    costs[name].append(a.cost)
            opt = np.array(costs["exact"])
            pack_gap = np.array(costs["pack"]) / opt - 1
            ff_gap = np.array(costs["first-fit"]) / opt - 1
            rows.append(
                {
                    "nodes": n_nodes,
                    "gang": learners,
                    "reps": reps[n_nodes],
                    "bsa_p50_ms": round(1e3 * float(np.percentile(times["pack"], 50)), 2),
                    "bsa_p99_ms": round(1e3 * float(np.percentile(times["pack"], 99)), 2),
                    "first_fit_p50_ms": round(
                        1e3 * float(np.percentile(times["first-fit"], 50)), 2
                    ),
                    "exact_p50_ms": round(1e3 * float(np.percentile(times["exact"], 50)), 2),
                    "bsa_gap_mean_pct": round(100 * float(pack_gap.mean()), 2),
                    "bsa_gap_max_pct": round(100 * float(pack_gap.max()), 2),
                    "bsa_optimal_pct": round(100 * float(np.mean(pack_gap < 1e-9)), 1),
                    "first_fit_gap_mean_pct": round(100 * float(ff_gap.mean()), 2),
                    "first_fit_gap_max_pct": round(100 * float(ff_gap.max()), 2),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    args = parser.parse_args()
    reps = {100: 200, 1000: 200, 10000: 60} if not args.quick else {100: 20, 1000: 20, 10000: 5}
    print(
        f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}, numpy {np.__version__}"
    )
    rows = run([100, 1000, 10000], [8, 64], reps)
    cols = list(rows[0])
    print("\n| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    worst = max(float(r["bsa_gap_max_pct"]) for r in rows)  # type: ignore[arg-type]
    p99_1k = max(float(r["bsa_p99_ms"]) for r in rows if r["nodes"] == 1000)  # type: ignore[arg-type]
    p99_10k = max(float(r["bsa_p99_ms"]) for r in rows if r["nodes"] == 10000)  # type: ignore[arg-type]
    print(f"\nBSA p99: {p99_1k} ms at 1,000 nodes (goal < 10), {p99_10k} ms at 10,000 (goal < 100)")
    print(f"BSA worst gap to the optimum: {worst} % (goal <= 2 %)")


if __name__ == "__main__":
    main()
