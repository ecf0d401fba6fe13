"""The kubernetes backend and our gang scheduler through the API emulator (issue #14).

Everything here runs against kmock (tests/kubernetes/emulator.py), a Kubernetes API
emulator in this process: there is no kubelet and no etcd behind it, so the figures are
the client-side and scheduler costs over HTTP on loopback, not a real cluster's latency.

1. Pods created and bound per second: J jobs × L learners deployed by the backend (owner
   ConfigMap, NetworkPolicy, credentials Secret, a spec Secret and a Pod per learner),
   then every gang placed and bound by the scheduler's round. Compared in the same run
   with the bare minimum the API needs for the same pods: one POST per pod plus one
   Binding per pod, no other object. Ratio: ours / bare pods per second.
2. Bind latency per gang on a 1,000-node cluster model built from watched Nodes: the
   nodes are created in the emulator and the scheduler's Node watch lists and follows
   them; then gangs of 4, 16 and 32 learners (--sizes) are placed (BSA `pack`) and bound, median
   per gang. Compared with the `first-fit` policy on the same model in the same run.
3. A binder round with P pods already in the cluster (--pods, bound, in other
   namespaces): reading the list+watch view (what `GangScheduler.run` does) against
   listing every pod for the round (what it did before), same emulator, same run.
   Ratio: watched / listed round time.

    .venv/bin/python benchmarks/k8s_backend.py [--jobs 10] [--learners 4] [--nodes 1000]
        [--sizes 4,16,32] [--reps 3] [--pods 300]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _platform import ROOT  # noqa: F401  (puts the repository on sys.path)
from kubernetes import client as k8s

from services.backends.kubernetes.api import KubeSettings
from services.backends.kubernetes.backend import KubernetesBackend
from services.backends.kubernetes.scheduler import GangScheduler
from tests.kubernetes.conftest import make_job
from tests.kubernetes.emulator import Emulator


def node(name: str, zone: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone}},
        "status": {
            "allocatable": {"cpu": "16", "memory": "64Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def add_nodes(emu: Emulator, count: int) -> None:
    """Stored in the emulator directly (1,000 POSTs would measure kmock, not us); the
    scheduler lists and watches them over HTTP like any client."""
    emu.seed([node(f"n{i:04d}", f"zone-{i % 3}") for i in range(count)])


def ours(settings: KubeSettings, jobs: int, learners: int, tmp: Path) -> float:
    backend = KubernetesBackend(settings)
    sched = GangScheduler(settings).start()
    sched.node_watch.synced.wait(30)
    start = time.perf_counter()
    for _ in range(jobs):
        job = make_job(tmp, learners=learners)
        backend.prepare_volume(job)
        backend.write_secrets(job)
        for rank in range(learners):
            backend.start_learner(job, rank, 0)
    outcome = sched.schedule_once()
    elapsed = time.perf_counter() - start
    bound = sum(len(v.split(",")) for v in outcome.values() if v.startswith("n"))
    assert bound == jobs * learners, outcome
    backend.close()
    sched.close()
    return jobs * learners / elapsed


# `api` is a kubernetes CoreV1Api, typed Any: it takes plain dicts as bodies (as the backend
# sends them), where its type stubs name model classes.
def bare(api: Any, namespace: str, pods: int) -> float:
    start = time.perf_counter()
    for i in range(pods):
        name = f"bare-{i}"
        api.create_namespaced_pod(
            namespace,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"containers": [{"name": "c", "image": "x"}]},
            },
            _preload_content=False,
        )
        api.create_namespaced_pod_binding(
            name,
            namespace,
            {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": name, "namespace": namespace},
                "target": {"apiVersion": "v1", "kind": "Node", "name": "n0000"},
            },
            _preload_content=False,
        )
    return pods / (time.perf_counter() - start)


def bind_latency(
    settings: KubeSettings, policy: str, sizes: list[int], reps: int, tmp: Path
) -> dict[int, float]:
    backend = KubernetesBackend(settings)
    sched = GangScheduler(settings, policy=policy).start()
    sched.node_watch.synced.wait(60)
    out: dict[int, float] = {}
    for size in sizes:
        times = []
        for _ in range(reps):
            job = make_job(tmp, learners=size)
            backend.prepare_volume(job)
            for rank in range(size):
                backend.start_learner(job, rank, 0)
            pods = sched._pods()
            gang = sched.gangs(pods)[job.job_id]
            start = time.perf_counter()
            cluster = sched.model(pods)
            placement = sched.place(cluster, job.job_id, gang)
            sched.bind_gang(settings.namespace, placement)
            times.append(time.perf_counter() - start)
            backend.rollback(job.job_id, "")
        out[size] = statistics.median(times)
    backend.close()
    sched.close()
    return out


def round_cost(settings: KubeSettings, api: Any, pods: int, reps: int) -> tuple[float, float]:
    """Median seconds of a binder round over `pods` bound pods: (watched view, listed)."""
    for i in range(pods):
        api.create_namespaced_pod(
            f"other-{i % 5}",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"p{i}", "namespace": f"other-{i % 5}"},
                "spec": {"nodeName": f"n{i % 32:04d}", "containers": [{"name": "c", "image": "x"}]},
                "status": {"phase": "Running"},
            },
            _preload_content=False,
        )
    sched = GangScheduler(settings).start()
    sched.node_watch.synced.wait(30)
    sched.pod_watch.synced.wait(30)
    deadline = time.monotonic() + 30
    while len(sched.pod_watch.pods()) < pods and time.monotonic() < deadline:
        time.sleep(0.05)
    watched, listed = [], []
    for _ in range(reps * 10):
        start = time.perf_counter()
        sched.schedule_once(sched.pod_watch.pods())
        watched.append(time.perf_counter() - start)
        start = time.perf_counter()
        sched.schedule_once()
        listed.append(time.perf_counter() - start)
    sched.close()
    return statistics.median(watched), statistics.median(listed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sizes", default="4,16,32", help="gang sizes, comma-separated")
    parser.add_argument("--pods", type=int, default=300, help="pods in the cluster (round cost)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rz-k8s-bench-"))

    # Each measurement on a fresh emulator with the same 32 nodes (kmock scans all its
    # objects per request, so a fuller emulator is slower), alternating, medians.
    rates: dict[str, list[float]] = {"ours": [], "bare": []}
    for _ in range(args.reps):
        for kind in ("ours", "bare"):
            emu = Emulator().start()
            try:
                add_nodes(emu, 32)
                settings = KubeSettings(server=emu.url, namespace="bench")
                if kind == "ours":
                    rates[kind].append(ours(settings, args.jobs, args.learners, tmp))
                else:
                    api = k8s.CoreV1Api(k8s.ApiClient(_config(emu.url)))
                    rates[kind].append(bare(api, "bench", args.jobs * args.learners))
            finally:
                emu.stop()
    ours_rate, bare_rate = (statistics.median(rates[k]) for k in ("ours", "bare"))
    print(
        f"pods created+bound per second ({args.jobs} jobs x {args.learners} learners, "
        f"emulator, median of {args.reps}): ours {ours_rate:.1f}/s, bare pod+binding "
        f"{bare_rate:.1f}/s, ratio {ours_rate / bare_rate:.2f}"
    )

    emu = Emulator().start()
    try:
        settings = KubeSettings(server=emu.url, namespace="bench")
        add_nodes(emu, args.nodes)
        sizes = [int(x) for x in args.sizes.split(",")]
        pack = bind_latency(settings, "pack", sizes, args.reps, tmp)
        first = bind_latency(settings, "first-fit", sizes, args.reps, tmp)
        for size in sizes:
            print(
                f"bind latency per gang of {size} on {args.nodes} watched nodes (model + "
                f"place + bind, median of {args.reps}): pack (BSA) {pack[size] * 1000:.1f} ms, "
                f"first-fit {first[size] * 1000:.1f} ms, ratio {pack[size] / first[size]:.2f}"
            )
    finally:
        emu.stop()

    emu = Emulator().start()
    try:
        add_nodes(emu, 32)
        settings = KubeSettings(server=emu.url, namespace="bench")
        api = k8s.CoreV1Api(k8s.ApiClient(_config(emu.url)))
        watched, listed = round_cost(settings, api, args.pods, args.reps)
        print(
            f"binder round with {args.pods} pods in the cluster (median of {args.reps * 10}): "
            f"watched view {watched * 1000:.2f} ms, listing every pod {listed * 1000:.2f} ms, "
            f"ratio {watched / listed:.3f}"
        )
    finally:
        emu.stop()


def _config(url: str) -> k8s.Configuration:
    cfg = k8s.Configuration()
    cfg.host = url
    return cfg


if __name__ == "__main__":
    main()
