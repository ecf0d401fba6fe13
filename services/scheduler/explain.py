"""Why a job waits (or where it runs), in words a user understands (`rhizome show`).

Example: "job j-7 is queued: needs 2 learners × 4 V100 on ≤ 2 nodes; the largest free
block is 3 V100 on node-7; room for 1 of its 2 learners now".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.scheduler.api import JobRequest
from services.scheduler.cluster import Cluster
from services.scheduler.quota import QuotaClass, QuotaLedger


def largest_free_block(cluster: Cluster, job: JobRequest) -> str:
    """'the largest free block is 3 V100 on node-7' for the resource the job is short of."""
    eligible = cluster.eligible(job)
    if not eligible.any():
        return "no node matches its GPU type and node selector"
    idx = np.flatnonzero(eligible)
    free: np.ndarray
    if job.gpus > 0:
        free, unit = cluster.gpus_free[idx], job.gpu_type
    elif job.cpus > 0:
        free, unit = cluster.cpus_free[idx], "CPUs"
    elif job.memory_mb > 0:
        free, unit = cluster.mem_free[idx], "MB of memory"
    else:
        return "it needs no resources"
    best = int(np.argmax(free))  # first maximum: deterministic
    if free[best] <= 0:
        return f"no {unit} is free on any suitable node"
    return f"the largest free block is {free[best]:g} {unit} on {cluster.nodes[idx[best]].name}"


def queued_reason(
    job: JobRequest,
    cluster: Cluster,
    ledger: QuotaLedger,
    *,
    ahead: int,
    blocked_by: str | None,
    preemptions: int,
    order_note: str | None = None,
) -> str:
    """``order_note``: what the queue's order (a scaling policy's, e.g. Elastic-Tiresias:
    "queue 1 of 3 (attained 12,340 GPU·s ...)") says of the job; none for FCFS."""
    parts = [f"job {job.job_id} is queued: needs {job.describe()}"]
    cls = ledger.classify(job)
    if cls == QuotaClass.OVER_LIMIT and ledger.config is not None:
        limit = ledger.config.limit(job.owner, job.gpu_type)
        parts.append(
            f"{job.owner or 'its owner'} already uses {ledger.used(job.owner, job.gpu_type)} "
            f"of a {limit} {job.gpu_type} limit; it starts when their other jobs finish"
        )
    elif cls == QuotaClass.OVER_QUOTA and ledger.config is not None:
        parts.append(
            f"{job.owner or 'its owner'} has used its {ledger.config.quota(job.owner, job.gpu_type)} "
            f"{job.gpu_type} quota and borrowing is off"
        )
    cap = cluster.capacity(job)
    room = int(cap.sum())
    fits_now = room >= job.learners
    if fits_now and job.max_nodes is not None:
        top = np.sort(cap)[::-1][: job.max_nodes]
        if int(top.sum()) < job.learners:
            fits_now = False
            parts.append(
                f"{largest_free_block(cluster, job)}; the {job.max_nodes} roomiest nodes "
                f"hold only {int(top.sum())} of its {job.learners} learners"
            )
    if not fits_now and room < job.learners:
        parts.append(
            f"{largest_free_block(cluster, job)}; room for {min(room, job.learners)} of its "
            f"{job.learners} learner{'s' if job.learners != 1 else ''} now"
        )
    if fits_now and cls in (QuotaClass.GUARANTEED, QuotaClass.BORROW) and ahead:
        who = f" (first: {blocked_by})" if blocked_by else ""
        parts.append(
            f"it fits, but {ahead} job{'s' if ahead != 1 else ''} ahead of it in the "
            f"{job.pool} queue must start first{who}"
        )
    elif fits_now and cls in (QuotaClass.GUARANTEED, QuotaClass.BORROW):
        parts.append("it fits now and starts at the next scheduling pass")
    if order_note:
        parts.append(order_note)
    if preemptions:
        parts.append(
            f"it was halted {preemptions} time{'s' if preemptions != 1 else ''} to return "
            "borrowed quota to its owner and resumes when GPUs free up"
        )
    return "; ".join(parts)


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"learner {ranks[0]}"
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"learners {ranks[0]}–{ranks[-1]}"
    return "learners " + ", ".join(str(r) for r in ranks)


def placed_reason(
    job: JobRequest, learner_nodes: Sequence[str], *, bound: bool, borrowing: bool
) -> str:
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(learner_nodes):
        by_node.setdefault(node, []).append(rank)
    where = ", ".join(f"{node} ({_ranks(ranks)})" for node, ranks in by_node.items())
    text = f"job {job.job_id} is {'running' if bound else 'placed'} on {where}"
    if not bound:
        text += "; its resources are reserved while its learners start"
    if borrowing:
        text += (
            f"; it borrows idle {job.gpu_type} quota and may be halted (not lost) "
            "when the quota's owner needs it"
        )
    return text
