"""Discrete-event replay of a job trace against a cluster, through the real GangScheduler.

Modes (``policy``):

- ``per-pod``: a Kubernetes-default-like baseline. Each learner is a pod scheduled on
  its own (a 1-learner request to the same GangScheduler, SPREAD scoring, every pending
  pod tried in creation order, no gang). A job runs only when all its pods are bound;
  the bound pods of an incomplete job hold GPUs and do nothing. Pods do not appear at
  the job's submit time: the LCM deploys jobs one after another (``deploy_gap_s``
  apart on average) and each job's pods appear over ``pod_spread_s``, so the pods of
  jobs submitted together interleave, as in FfDL.
- any registered placement policy (``pack``, ``spread``, ...): gang scheduling.

Metrics, taken after every scheduling pass:

- deadlocked learners: learners bound to a node while their job is deadlocked: all of
  the job's pods exist, some cannot be placed (the pass has placed all it could), and
  what they need is held by other jobs (a node of the right GPU type would fit them
  without the other jobs' pods on it). Max over the run.
- waiting for siblings: learners bound while some of their job's pods have not been
  created yet. Not a deadlock (the siblings may well fit when they come), so a job alone
  on an empty cluster never counts as deadlocked; its own figure. Max over the run.
- idle GPUs: the share of the cluster's GPUs held by deadlocked learners. Max over the run.
- queueing delay (submit → all learners placed), jobs queued over 15 minutes,
  GPU utilization (busy GPU-time of running jobs / cluster GPU-time until the last job
  ends), job completion time (submit → end).
- permanent deadlock: pods still pending with nothing running and nothing to come.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from services.scheduler.api import JobRequest
from services.scheduler.cluster import Cluster, Node
from services.scheduler.scheduler import GangScheduler
from services.scheduler.sim.trace import TraceJob

PER_POD = "per-pod"
QUEUED_TOO_LONG_S = 15 * 60
_EPS = 1e-9  # CPU and memory are floats: a pod that exactly fills a node fits


@dataclass
class SimResult:
    policy: str
    seed: int
    jobs: int
    completed: int
    deadlocked_learners_max: int
    idle_gpu_frac_max: float
    permanent_deadlock: bool
    queued_over_15min: int
    utilization: float
    makespan_s: float
    waiting_for_siblings_max: int = 0
    queue_delays_s: list[float] = field(default_factory=list, repr=False)
    # job id -> the node of each learner, in rank order (per-pod: in binding order)
    placements: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False)
    jcts_s: list[float] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, float | int | str | bool]:
        delays = np.array(self.queue_delays_s) if self.queue_delays_s else np.zeros(1)
        jcts = np.array(self.jcts_s) if self.jcts_s else np.zeros(1)
        return {
            "policy": self.policy,
            "seed": self.seed,
            "jobs": self.jobs,
            "completed": self.completed,
            "deadlocked_learners_max": self.deadlocked_learners_max,
            "idle_gpu_pct_max": round(100 * self.idle_gpu_frac_max, 1),
            "waiting_for_siblings_max": self.waiting_for_siblings_max,
            "permanent_deadlock": self.permanent_deadlock,
            "queued_over_15min": self.queued_over_15min,
            "queue_delay_p50_min": round(float(np.percentile(delays, 50)) / 60, 1),
            "queue_delay_p90_min": round(float(np.percentile(delays, 90)) / 60, 1),
            "queue_delay_max_min": round(float(delays.max()) / 60, 1),
            "utilization_pct": round(100 * self.utilization, 1),
            "jct_mean_min": round(float(jcts.mean()) / 60, 1),
            "makespan_h": round(self.makespan_s / 3600, 2),
        }


def _held_by_others(cluster: Cluster, job: TraceJob, own: dict[int, int]) -> bool:
    """Whether a pending pod of ``job`` is kept out by other jobs: some node that suits
    it (its GPU type, when it asks for GPUs) could hold it if only the job's own pods
    (``own``: node index -> pods) were on it. (Called after a pass that placed every pod
    that fits, so no such node has room now.) A pod no node could ever hold is
    unschedulable, not deadlocked."""
    for idx, node in enumerate(cluster.nodes):
        if job.gpus > 0 and node.gpu_type != job.gpu_type:
            continue
        room = own.get(idx, 0) + 1  # the job's pods there, and one more
        if (
            node.gpus >= room * job.gpus
            and node.cpus + _EPS >= room * job.cpus
            and node.memory_mb + _EPS >= room * job.memory_mb
        ):
            return True
    return False


def simulate(
    trace: Sequence[TraceJob],
    nodes: Sequence[Node],
    policy: str,
    *,
    seed: int = 0,
    backfill: bool = False,
    deploy_gap_s: float = 0.5,
    pod_spread_s: float = 5.0,
) -> SimResult:
    cluster = Cluster(nodes)
    per_pod = policy == PER_POD
    sched = GangScheduler(
        cluster,
        policy="spread" if per_pod else policy,
        seed=seed,
        # the per-pod baseline has no gang order: pods in creation order, every pod tried
        backfill=True if per_pod else backfill,
        batch_window_s=0.0 if per_pod else 1.0,
    )
    rng = np.random.default_rng([seed, 7])
    jobs = {j.job_id: j for j in trace}
    events: list[tuple[float, int, str, str]] = []  # (time, seq, kind, id)
    seq = 0

    def push(t: float, kind: str, ident: str) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, ident))
        seq += 1

    pod_ids: dict[str, list[str]] = {}
    created: dict[str, int] = {j: (0 if per_pod else jobs[j].learners) for j in jobs}
    node_index = {n.name: i for i, n in enumerate(cluster.nodes)}
    # how many of each job's pods are bound on each node (by node index)
    held: dict[str, dict[int, int]] = {j: {} for j in jobs}
    placed: dict[str, tuple[str, ...]] = {}
    if per_pod:
        # The LCM deploys in submit order; a job's pods appear over pod_spread_s.
        deploy_at = 0.0
        for job in sorted(trace, key=lambda j: j.arrival_s):
            deploy_at = max(deploy_at, job.arrival_s) + float(rng.exponential(deploy_gap_s))
            pod_ids[job.job_id] = [f"{job.job_id}/pod-{r}" for r in range(job.learners)]
            for pod in pod_ids[job.job_id]:
                push(deploy_at + float(rng.uniform(0, pod_spread_s)), "pod", pod)
    else:
        for job in trace:
            push(job.arrival_s, "arrive", job.job_id)

    bound_pods: dict[str, int] = {j: 0 for j in jobs}
    started: dict[str, float] = {}
    total_gpus = cluster.total_gpus()
    busy_gpu_s = 0.0
    dead_max = 0
    siblings_max = 0
    idle_max = 0.0
    completed = 0
    now = 0.0
    while events:
        now = events[0][0]
        while events and events[0][0] == now:
            _, _, kind, ident = heapq.heappop(events)
            if kind == "arrive":
                j = jobs[ident]
                sched.submit(
                    JobRequest(
                        j.job_id,
                        learners=j.learners,
                        gpus=j.gpus,
                        gpu_type=j.gpu_type,
                        cpus=j.cpus,
                        memory_mb=j.memory_mb,
                        owner=j.owner,
                        arrival=now,
                    )
                )
            elif kind == "pod":
                j = jobs[ident.split("/")[0]]
                created[j.job_id] += 1
                sched.submit(
                    JobRequest(
                        ident,
                        learners=1,
                        gpus=j.gpus,
                        gpu_type=j.gpu_type,
                        cpus=j.cpus,
                        memory_mb=j.memory_mb,
                        owner=j.owner,
                        arrival=now,
                    )
                )
            else:  # finish
                j = jobs[ident]
                for pid in pod_ids.get(ident, [ident]):
                    sched.release(pid)
                completed += 1
        for placement in sched.schedule(now).placements:
            job_id = placement.job_id.split("/")[0]
            bound_pods[job_id] += len(placement.learner_nodes)
            j = jobs[job_id]
            placed[job_id] = placed.get(job_id, ()) + tuple(placement.learner_nodes)
            for name in placement.learner_nodes:
                idx = node_index[name]
                held[job_id][idx] = held[job_id].get(idx, 0) + 1
            if bound_pods[job_id] == j.learners and job_id not in started:
                started[job_id] = now
                busy_gpu_s += j.learners * j.gpus * j.duration_s
                push(now + j.duration_s, "finish", job_id)
        partial = [jid for jid, n in bound_pods.items() if 0 < n < jobs[jid].learners]
        siblings = sum(bound_pods[jid] for jid in partial if created[jid] < jobs[jid].learners)
        deadlocked = [
            jid
            for jid in partial
            if created[jid] == jobs[jid].learners and _held_by_others(cluster, jobs[jid], held[jid])
        ]
        dead = sum(bound_pods[jid] for jid in deadlocked)
        idle = sum(bound_pods[jid] * jobs[jid].gpus for jid in deadlocked)
        dead_max = max(dead_max, dead)
        siblings_max = max(siblings_max, siblings)
        idle_max = max(idle_max, idle / total_gpus if total_gpus else 0.0)
    permanent = len(started) < len(jobs)
    delays = [started[j] - jobs[j].arrival_s for j in started]
    jcts = [started[j] + jobs[j].duration_s - jobs[j].arrival_s for j in started]
    makespan = max((started[j] + jobs[j].duration_s for j in started), default=0.0)
    return SimResult(
        policy=policy,
        seed=seed,
        jobs=len(jobs),
        completed=completed,
        deadlocked_learners_max=dead_max,
        idle_gpu_frac_max=idle_max,
        waiting_for_siblings_max=siblings_max,
        permanent_deadlock=permanent,
        queued_over_15min=sum(1 for d in delays if d > QUEUED_TOO_LONG_S)
        + (len(jobs) - len(started)),
        utilization=busy_gpu_s / (total_gpus * makespan) if makespan and total_gpus else 0.0,
        makespan_s=makespan,
        queue_delays_s=delays,
        jcts_s=jcts,
        placements=placed,
    )
