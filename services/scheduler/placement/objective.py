"""What a good placement is, shared by BSA, the baselines and the exact solver.

PACK cost of an assignment (``k[i]`` learners on node ``i``), summed over used nodes::

    1 + leftover_i        leftover_i = primary resource still free on node i afterwards,
                                       as a fraction of node i's total (in [0, 1))

so the number of nodes dominates (the gang stays on few nodes) and, among placements
on as many nodes, the one leaving those nodes fullest wins — which keeps whole nodes
free for the next big gang. The cost is a sum over nodes, so its exact optimum is a
small dynamic programme (``baselines.ExactPackPolicy``).

SPREAD cost: ``k_i² + fullness_i`` over used nodes — one learner per node on the
emptiest nodes, the Kubernetes-default behaviour FfDL compares against.

Zone conflicts (two consecutive pipeline stages in one zone; the ring closes for
three or more stages, since the last stage backs up the first) weigh more than any
node term, so a zone-aware job never trades zone separation for packing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.scheduler.api import JobRequest
from services.scheduler.cluster import Cluster


def leftover(cluster: Cluster, job: JobRequest, idx: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Fraction of the primary resource left free on nodes ``idx`` after ``counts`` learners."""
    free, total, need = cluster.primary(job)
    tot = np.maximum(total[idx], 1e-12)
    return np.clip((free[idx] - counts * need) / tot, 0.0, 1.0)


def pack_cost(cluster: Cluster, job: JobRequest, idx: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """PACK cost per row of ``(idx, counts)`` matrices (or per element for 1-D inputs)."""
    used = counts > 0
    return np.sum(np.where(used, 1.0 + leftover(cluster, job, idx, counts), 0.0), axis=-1)


def spread_cost(
    cluster: Cluster, job: JobRequest, idx: np.ndarray, counts: np.ndarray
) -> np.ndarray:
    used = counts > 0
    full = 1.0 - leftover(cluster, job, idx, counts)
    return np.sum(np.where(used, counts.astype(np.float64) ** 2 + full, 0.0), axis=-1)


def zone_weight(job: JobRequest) -> float:
    """Larger than any possible node term of either objective."""
    return float(job.learners) ** 2 * 4.0 + 8.0


def ring_conflicts(zones: Sequence[int]) -> int:
    """Consecutive stages sharing a zone; for 3+ stages the last and first are neighbours."""
    n = len(zones)
    if n < 2:
        return 0
    conflicts = sum(1 for i in range(n - 1) if zones[i] == zones[i + 1])
    if n >= 3 and zones[-1] == zones[0]:
        conflicts += 1
    return conflicts


def arrange_by_zone(nodes: Sequence[int], zone_of: np.ndarray) -> list[int]:
    """Order learners (node indices, one per learner) so that neighbours differ in zone.

    Largest zone first into the even ranks, then the odd ones: neighbours differ whenever
    no zone holds more than half the gang. Learners of one node stay in consecutive slots
    of their zone, which keeps the order deterministic.
    """
    by_zone: dict[int, list[int]] = {}
    for idx in nodes:
        by_zone.setdefault(int(zone_of[idx]), []).append(int(idx))
    groups = sorted(by_zone.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    flat = [idx for _, members in groups for idx in members]
    n = len(flat)
    slots = list(range(0, n, 2)) + list(range(1, n, 2))
    out = [0] * n
    for slot, idx in zip(slots, flat, strict=True):
        out[slot] = idx
    return out


def candidate_classes(
    cluster: Cluster, job: JobRequest, cap: np.ndarray, *, per_node_one: bool
) -> np.ndarray:
    """Node indices worth considering, in a deterministic order.

    Nodes with the same capacity for this job, the same free and total primary resource
    (and, for zone-aware jobs, the same zone) are interchangeable for both objectives,
    so keeping the lowest-indexed few of each class loses nothing: ``ceil(L / cap)`` of
    a class can hold the whole gang (``L`` when learners go one per node, SPREAD).
    """
    cand = np.flatnonzero(cap > 0)
    if cand.size == 0:
        return cand
    free, total, _ = cluster.primary(job)
    zone = cluster.zone_id[cand] if job.zone_aware else np.zeros(cand.size, dtype=np.int64)
    c = cap[cand]
    order = np.lexsort((cand, zone, total[cand], free[cand], c))
    cand, c, zone = cand[order], c[order], zone[order]
    f, t = free[cand], total[cand]
    new_group = np.ones(cand.size, dtype=bool)
    new_group[1:] = (
        (c[1:] != c[:-1]) | (f[1:] != f[:-1]) | (t[1:] != t[:-1]) | (zone[1:] != zone[:-1])
    )
    starts = np.flatnonzero(new_group)
    group_id = np.cumsum(new_group) - 1
    rank_in_group = np.arange(cand.size) - starts[group_id]
    limit = (
        np.full(cand.size, job.learners) if per_node_one else -(-job.learners // np.maximum(c, 1))
    )
    keep = rank_in_group < limit
    return np.sort(cand[keep])
