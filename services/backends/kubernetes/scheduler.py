"""Our gang scheduler on Kubernetes: it binds the pods whose `schedulerName` is `rhizome`.

The cluster model comes from the Nodes it watches (list+watch, 410 -> relist, as for
pods): allocatable `cpu`, `memory` and `nvidia.com/gpu`; the zone from
`topology.kubernetes.io/zone`; spot capacity from the cloud providers' capacity-type
labels (recorded as the node label `rhizome.io/spot=true`); the GPU type from
`rhizome.io/gpu-type` (else `nvidia.com/gpu.product`). A cordoned node, one that is not
Ready, or one with a NoSchedule/NoExecute taint our pods do not tolerate is not in the
model, so nodes added, removed, cordoned or tainted change it at the next event. What
running pods already request is taken off their nodes' free resources.

A gang — the pending pods of one job's generation — is placed only when all its pods
exist: on the nodes the platform's scheduler service recorded for the job (each pod's
`rhizome.io/scheduled-node` annotation) when they are still there and the gang fits,
else with the scheduler's own placement policy (BSA `pack` by default, zone-aware for
pipeline jobs: services/scheduler/placement), and bound through the Binding subresource:
every pod or none (a failed binding deletes the pods of the gang it already bound, and
the guardian starts them again). A gang that does not fit gets the reason on its pods'
`PodScheduled` condition, which the backend reports if the pod stays Pending.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.utils.quantity import parse_quantity

from services.backends.kubernetes.api import (
    SCHEDULER_NAME,
    GangBindError,
    GangUnplaceable,
    KubernetesBackendError,
    KubeSettings,
    PodBinder,
    describe_api_error,
)
from services.backends.kubernetes.client import Calls, api_client, json_body
from services.backends.kubernetes.spec import (
    ANNOTATION_NODE,
    GPU_RESOURCE,
    LABEL_GENERATION,
    LABEL_GPU_TYPE,
    LABEL_JOB,
    LABEL_LEARNERS,
    LABEL_RANK,
    LABEL_ZONE_AWARE,
)
from services.backends.kubernetes.watch import ListWatch
from services.scheduler.api import JobRequest, OverCommitError
from services.scheduler.cluster import Cluster, Node
from services.scheduler.placement import get_policy

log = logging.getLogger(__name__)

ZONE_LABELS = ("topology.kubernetes.io/zone", "failure-domain.beta.kubernetes.io/zone")
GPU_TYPE_LABELS = (LABEL_GPU_TYPE, "nvidia.com/gpu.product")
SPOT_LABEL = "rhizome.io/spot"
# The capacity-type labels of the clouds and autoscalers, and the values that mean spot.
SPOT_MARKERS: Mapping[str, frozenset[str]] = {
    "eks.amazonaws.com/capacityType": frozenset({"SPOT"}),
    "karpenter.sh/capacity-type": frozenset({"spot"}),
    "cloud.google.com/gke-spot": frozenset({"true"}),
    "cloud.google.com/gke-preemptible": frozenset({"true"}),
    "kubernetes.azure.com/scalesetpriority": frozenset({"spot"}),
    "node.kubernetes.io/lifecycle": frozenset({"spot", "preemptible"}),
}
# Taints our learner pods tolerate (spec.py): GPU nodes' own.
TOLERATED_TAINTS = frozenset({GPU_RESOURCE})
_MB = 1024 * 1024
# A round runs at least this often without a watch event (a gang waiting for resources
# that other pods' ends free is woken by their events anyway; this is a safety net).
RESYNC_S = 5.0


def _quantity(value: Any) -> float:
    try:
        return float(parse_quantity(value)) if value not in (None, "") else 0.0
    except ValueError:
        return 0.0


def node_from_object(obj: Mapping[str, Any]) -> Node | None:
    """The scheduler's Node for a Kubernetes Node, or None when pods cannot go there."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    if spec.get("unschedulable"):
        return None
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Ready" and cond.get("status") != "True":
            return None
    for taint in spec.get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and (
            taint.get("key") not in TOLERATED_TAINTS
        ):
            return None
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    alloc = status.get("allocatable") or {}
    gpus = int(_quantity(alloc.get(GPU_RESOURCE)))
    gpu_type = next((labels[k] for k in GPU_TYPE_LABELS if labels.get(k)), "gpu")
    zone = next((labels[k] for k in ZONE_LABELS if labels.get(k)), "default")
    if any(labels.get(k) in values for k, values in SPOT_MARKERS.items()):
        labels[SPOT_LABEL] = "true"
    return Node(
        name=str(meta.get("name", "")),
        cpus=_quantity(alloc.get("cpu")),
        memory_mb=_quantity(alloc.get("memory")) / _MB,
        gpus=gpus,
        gpu_type=gpu_type if gpus > 0 else "",
        zone=zone,
        labels=labels,
    )


@dataclass(frozen=True)
class PodRequest:
    cpus: float
    memory_mb: float
    gpus: int

    @classmethod
    def of(cls, pod: Mapping[str, Any]) -> PodRequest:
        cpus = mem = 0.0
        gpus = 0
        for container in (pod.get("spec") or {}).get("containers") or []:
            res = container.get("resources") or {}
            req = {**(res.get("limits") or {}), **(res.get("requests") or {})}
            cpus += _quantity(req.get("cpu"))
            mem += _quantity(req.get("memory")) / _MB
            gpus += int(_quantity(req.get(GPU_RESOURCE)))
        return cls(cpus, mem, gpus)


class NodeWatch(ListWatch):
    """The cluster's Nodes, kept as the scheduler's Node (None: not schedulable now)."""

    def __init__(self, core: k8s.CoreV1Api, calls: Calls) -> None:
        super().__init__(calls, "nodes", core.list_node)
        self._nodes: dict[str, Node | None] = {}

    def replace_all(self, items: list[dict[str, Any]]) -> None:
        found = {str(o["metadata"]["name"]): node_from_object(o) for o in items}
        with self._lock:
            self._nodes = found

    def apply_object(self, kind: str, obj: dict[str, Any]) -> None:
        name = str((obj.get("metadata") or {}).get("name", ""))
        with self._lock:
            if kind == "DELETED":
                self._nodes.pop(name, None)
            else:
                self._nodes[name] = node_from_object(obj)

    def nodes(self) -> list[Node]:
        with self._lock:
            return sorted((n for n in self._nodes.values() if n is not None), key=lambda n: n.name)


class AllPodsWatch(ListWatch):
    """Every pod of the cluster (namespace/name -> the object): the gangs waiting for us
    and what bound pods take from their nodes. List+watch like the nodes, so a round reads
    this view instead of listing every pod again."""

    def __init__(self, core: k8s.CoreV1Api, calls: Calls) -> None:
        super().__init__(calls, "scheduler: pods", core.list_pod_for_all_namespaces)
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}

    @staticmethod
    def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
        meta = obj.get("metadata") or {}
        return str(meta.get("namespace") or ""), str(meta.get("name") or "")

    def replace_all(self, items: list[dict[str, Any]]) -> None:
        found = {self._key(o): o for o in items}
        with self._lock:
            self._pods = found

    def apply_object(self, kind: str, obj: dict[str, Any]) -> None:
        with self._lock:
            if kind == "DELETED":
                self._pods.pop(self._key(obj), None)
            else:
                self._pods[self._key(obj)] = obj

    def bound(self, namespace: str, name: str, node: str) -> None:
        """A binding this process made, before the watch reports it, so the next round
        neither binds the pod again nor forgets what it takes from the node."""
        with self._lock:
            pod = self._pods.get((namespace, name))
            if pod is not None and not (pod.get("spec") or {}).get("nodeName"):
                self._pods[(namespace, name)] = {**pod, "spec": {**pod["spec"], "nodeName": node}}

    def pods(self) -> list[dict[str, Any]]:
        """A copy of each pod's top level and spec: a round may book nodes on its copy."""
        with self._lock:
            return [{**p, "spec": dict(p.get("spec") or {})} for p in self._pods.values()]


def _live(pod: Mapping[str, Any]) -> bool:
    meta = pod.get("metadata") or {}
    phase = (pod.get("status") or {}).get("phase") or "Pending"
    return not meta.get("deletionTimestamp") and phase not in ("Succeeded", "Failed")


class GangScheduler(PodBinder):
    def __init__(
        self,
        settings: KubeSettings,
        api: k8s.ApiClient | None = None,
        policy: str = "pack",
        seed: int = 0,
    ) -> None:
        self.settings = settings
        self.api = api or api_client(settings)
        self.core = k8s.CoreV1Api(self.api)
        self.calls = Calls(settings)
        self.namespace = settings.namespace
        self.policy = get_policy(policy)
        self.rng = np.random.default_rng(seed)
        self.node_watch = NodeWatch(self.core, self.calls)
        self.pod_watch = AllPodsWatch(self.core, self.calls)
        self.rounds = 0  # rounds `run` made (each reads the watched pods, lists none)
        self._explained: dict[str, str] = {}  # job -> the reason last written on its pods

    def start(self) -> GangScheduler:
        self.node_watch.start()
        self.pod_watch.start()
        return self

    def close(self) -> None:
        self.node_watch.stop()
        self.pod_watch.stop()

    # -- the model ---------------------------------------------------------------------
    def model(self, pods: list[dict[str, Any]]) -> Cluster:
        """The nodes as watched, less what the live pods bound to them request."""
        cluster = Cluster(self.node_watch.nodes())
        for pod in pods:
            node = (pod.get("spec") or {}).get("nodeName")
            idx = cluster.index.get(str(node)) if node else None
            if idx is None or not _live(pod):
                continue
            req = PodRequest.of(pod)
            cluster.cpus_free[idx] -= req.cpus
            cluster.mem_free[idx] -= req.memory_mb
            cluster.gpus_free[idx] -= req.gpus
        return cluster

    def _pods(self) -> list[dict[str, Any]]:
        """One list of every pod: a round asked for outside the watch loop."""
        body = json_body(
            self.calls.call(
                "scheduler: listing pods",
                self.core.list_pod_for_all_namespaces,
                _preload_content=False,
            )
        )
        return list(body.get("items") or [])

    # -- placing -------------------------------------------------------------------------
    @staticmethod
    def gangs(pods: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        """The complete gangs waiting for us: job -> its unbound pods, when every pod of
        the job's newest generation exists (bound or not)."""
        ours = [
            p
            for p in pods
            if (p.get("spec") or {}).get("schedulerName") == SCHEDULER_NAME
            and _live(p)
            and ((p.get("metadata") or {}).get("labels") or {}).get(LABEL_JOB)
        ]
        by_job: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for pod in ours:
            labels = pod["metadata"]["labels"]
            by_job.setdefault((labels[LABEL_JOB], labels.get(LABEL_GENERATION, "")), []).append(pod)
        out: dict[str, list[dict[str, Any]]] = {}
        for (job, _gen), members in by_job.items():
            waiting = [p for p in members if not (p.get("spec") or {}).get("nodeName")]
            want = int(members[0]["metadata"]["labels"].get(LABEL_LEARNERS, len(members)))
            ranks = {p["metadata"]["labels"].get(LABEL_RANK) for p in members}
            if waiting and len(ranks) >= want:
                out[job] = sorted(waiting, key=lambda p: int(p["metadata"]["labels"][LABEL_RANK]))
        return out

    def place(self, cluster: Cluster, job_id: str, pods: list[dict[str, Any]]) -> dict[str, str]:
        """pod name -> node name for the whole gang, or GangUnplaceable saying why."""
        req = PodRequest.of(pods[0])
        labels = pods[0]["metadata"]["labels"]
        request = JobRequest(
            job_id=job_id,
            learners=len(pods),
            gpus=req.gpus,
            gpu_type=str(labels.get(LABEL_GPU_TYPE, "gpu")) if req.gpus else "",
            cpus=req.cpus,
            memory_mb=req.memory_mb,
            zone_aware=labels.get(LABEL_ZONE_AWARE) == "true",
        )
        if not cluster.nodes:
            raise GangUnplaceable(f"job {job_id}: the cluster has no schedulable node")
        recorded = self.recorded_placement(cluster, request, pods)
        if recorded is not None:
            return recorded
        found = self.policy.place(cluster, request, self.rng)
        if found is None:
            raise GangUnplaceable(self.explain(cluster, request))
        return {
            str(pod["metadata"]["name"]): cluster.nodes[idx].name
            for pod, idx in zip(pods, found.learner_nodes, strict=True)
        }

    @staticmethod
    def recorded_placement(
        cluster: Cluster, request: JobRequest, pods: list[dict[str, Any]]
    ) -> dict[str, str] | None:
        """The nodes the platform's scheduler service chose for this gang (each pod's
        ANNOTATION_NODE, from the job's recorded placement), when every pod has one, every
        node is still in the model and the gang fits there now; else None, and our own
        policy places the gang (a node removed or filled since the choice, or pods made
        outside the platform). Both read the same watched Nodes, so honouring the choice
        keeps `rhizome show`'s placement and the pods' nodes the same."""
        chosen = [
            ((pod["metadata"].get("annotations") or {}).get(ANNOTATION_NODE) or "") for pod in pods
        ]
        if not all(chosen):
            return None
        indices = [cluster.index.get(name) for name in chosen]
        if any(idx is None for idx in indices):
            gone = sorted({n for n, i in zip(chosen, indices, strict=True) if i is None})
            log.info("job %s: recorded node(s) %s gone; placing anew", request.job_id, gone)
            return None
        try:  # a trial booking: the round's model is rebuilt after the gang is bound
            cluster.allocate(request, [int(idx) for idx in indices if idx is not None])
        except OverCommitError as exc:
            log.info("job %s: the recorded placement no longer fits (%s)", request.job_id, exc)
            return None
        cluster.release(request.job_id)
        return {str(pod["metadata"]["name"]): name for pod, name in zip(pods, chosen, strict=True)}

    @staticmethod
    def explain(cluster: Cluster, job: JobRequest) -> str:
        need = job.describe()
        if job.gpus and job.gpu_type not in cluster.gpu_types:
            have = ", ".join(cluster.gpu_types) or "none"
            return (
                f"{need}: no node has GPUs of type {job.gpu_type!r} (GPU types: {have}); "
                f"label GPU nodes {LABEL_GPU_TYPE}=<type>"
            )
        if int(cluster.capacity(job, empty=True).sum()) < job.learners:
            biggest = (
                f"the largest node has {cluster.cpus_total.max():g} CPUs, "
                f"{cluster.mem_total.max():g} MB, {int(cluster.gpus_total.max())} GPUs"
            )
            return f"{need}: can never fit on this cluster ({biggest})"
        return f"{need}: waiting for free resources (the cluster is busy)"

    def bind_gang(self, namespace: str, placement: Mapping[str, str]) -> None:
        """Bind every pod through the Binding subresource, or none: on a failure the pods
        already bound are deleted (a binding cannot be undone; the guardian starts the
        learners again and the gang is placed anew)."""
        bound: list[str] = []
        for pod, node in placement.items():
            body = {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": pod, "namespace": namespace},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node},
            }
            try:
                self.calls.call(
                    f"binding pod {pod} to {node}",
                    self.core.create_namespaced_pod_binding,
                    pod,
                    namespace,
                    body,
                    _preload_content=False,
                )
            except (ApiException, KubernetesBackendError) as exc:
                why = describe_api_error(exc) if isinstance(exc, ApiException) else str(exc)
                for done in bound:
                    try:
                        self.calls.call(
                            f"unbinding pod {done}",
                            self.core.delete_namespaced_pod,
                            done,
                            namespace,
                            grace_period_seconds=0,
                            _preload_content=False,
                        )
                    except ApiException as undo:
                        if undo.status != 404:
                            log.warning("could not delete bound pod %s: %s", done, undo)
                raise GangBindError(
                    f"binding pod {pod} to node {node} failed ({why}); the {len(bound)} pod(s) "
                    "of the gang already bound were deleted"
                ) from exc
            bound.append(pod)
            self.pod_watch.bound(namespace, pod, node)

    def _explain_on_pods(
        self, namespace: str, job_id: str, pods: list[dict[str, Any]], why: str
    ) -> None:
        if self._explained.get(job_id) == why:
            return
        self._explained[job_id] = why
        condition = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": why,
            "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        for pod in pods:
            try:
                self.calls.call(
                    "scheduler: explaining a pending pod",
                    self.core.patch_namespaced_pod_status,
                    pod["metadata"]["name"],
                    namespace,
                    {"status": {"conditions": [condition]}},
                    _preload_content=False,
                )
            except ApiException as exc:
                log.info("could not explain pod %s: %s", pod["metadata"]["name"], exc)

    def schedule_once(self, pods: list[dict[str, Any]] | None = None) -> dict[str, str]:
        """Place and bind every complete gang waiting now; job -> node list or reason.
        `pods`: the watched view (`run`); None lists them once (a round outside the loop)."""
        pods = self._pods() if pods is None else pods
        outcome: dict[str, str] = {}
        cluster = self.model(pods)
        for job_id, members in sorted(self.gangs(pods).items()):
            namespace = str(members[0]["metadata"].get("namespace") or self.namespace)
            try:
                placement = self.place(cluster, job_id, members)
                self.bind_gang(namespace, placement)
            except GangUnplaceable as exc:
                outcome[job_id] = str(exc)
                self._explain_on_pods(namespace, job_id, members, str(exc))
                continue
            except GangBindError as exc:
                outcome[job_id] = str(exc)
                log.warning("job %s: %s", job_id, exc)
                continue
            self._explained.pop(job_id, None)
            # Book the gang in this round's model so the next gang sees it.
            for pod in members:
                pod.setdefault("spec", {})["nodeName"] = placement[pod["metadata"]["name"]]
            cluster = self.model(pods)
            outcome[job_id] = ",".join(placement.values())
        return outcome

    def run(self, stop: threading.Event, interval_s: float = 0.5) -> None:
        """Schedule until `stop`. A round runs when the pod or node watch reports a change
        (a new pod, a binding, a node cordoned), at most every `interval_s`, and at least
        every RESYNC_S (a gang that waits for resources others free)."""
        self.start()
        self.node_watch.synced.wait(timeout=30)
        self.pod_watch.synced.wait(timeout=30)
        last = 0.0
        while not stop.is_set():
            self.pod_watch.changed.clear()
            self.node_watch.changed.clear()
            try:
                self.rounds += 1
                self.schedule_once(self.pod_watch.pods())
            except Exception as exc:  # the API server went away: keep trying
                log.warning("scheduler round failed: %s", exc)
            last = time.monotonic()
            stop.wait(interval_s)
            while not stop.is_set() and time.monotonic() - last < RESYNC_S:
                if self.pod_watch.changed.is_set() or self.node_watch.changed.is_set():
                    break
                stop.wait(min(interval_s, 0.1))


def main(argv: list[str] | None = None) -> int:
    """`python -m services.backends.kubernetes.scheduler`: bind our pods until SIGTERM
    (the chart runs it beside the daemon; settings from RHIZOME_K8S_*)."""
    import argparse
    import signal
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m services.backends.kubernetes.scheduler",
        description="Rhizome's gang scheduler for pods with schedulerName: rhizome.",
    )
    parser.add_argument("--policy", default="pack", help="placement policy (pack, spread, ...)")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between rounds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        sched = GangScheduler(KubeSettings.from_environ(), policy=args.policy)
    except Exception as exc:  # a clear line, not a traceback
        print(f"rhizome-k8s-scheduler: cannot start: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        sched.run(stop, args.interval)
    finally:
        sched.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
