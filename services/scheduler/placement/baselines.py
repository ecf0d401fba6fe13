"""Reference policies BSA is measured against: first-fit and the exact PACK optimum."""

from __future__ import annotations

import numpy as np

from services.scheduler.api import Assignment, JobRequest, PlacementPolicy
from services.scheduler.cluster import Cluster
from services.scheduler.placement import objective as obj
from services.scheduler.placement.bsa import fill_pack, fill_zoned


class FirstFitPolicy(PlacementPolicy):
    """Nodes in configuration order, each filled as far as the gang allows (no ranking)."""

    name = "first-fit"

    def place(
        self, cluster: Cluster, job: JobRequest, rng: np.random.Generator
    ) -> Assignment | None:
        cap = cluster.capacity(job)
        idx = np.flatnonzero(cap > 0)
        if int(cap[idx].sum()) < job.learners:
            return None
        zones = cluster.zone_id[idx]
        zoned = job.zone_aware and job.learners >= 2 and np.unique(zones).size >= 2
        if zoned:
            counts = fill_zoned(cap[idx], zones, job.learners, spread=False)
        else:
            counts = fill_pack(cap[idx], job.learners)
        if job.max_nodes is not None and int((counts > 0).sum()) > job.max_nodes:
            return None
        learners = [int(i) for i, k in zip(idx, counts, strict=True) for _ in range(int(k))]
        conflicts = 0
        if zoned:
            learners = obj.arrange_by_zone(learners, cluster.zone_id)
            conflicts = obj.ring_conflicts([int(cluster.zone_id[i]) for i in learners])
        return Assignment(
            tuple(learners), float(obj.pack_cost(cluster, job, idx, counts)), conflicts
        )


class ExactPackPolicy(PlacementPolicy):
    """The minimum PACK cost, by dynamic programming over nodes (the cost is a sum per node).

    ``best[j]`` = cheapest way to place ``j`` learners on the nodes seen so far; a node
    taking ``k`` learners adds ``1 + leftover(k)``. With ``max_nodes`` the table gains a
    node-count dimension. Zones are ignored: this is the packing yardstick.
    O(candidates × learners²) after ``candidate_classes`` drops interchangeable nodes.
    """

    name = "exact"

    def place(
        self, cluster: Cluster, job: JobRequest, rng: np.random.Generator
    ) -> Assignment | None:
        cap_all = cluster.capacity(job)
        cand = obj.candidate_classes(cluster, job, cap_all, per_node_one=False)
        n_learn = job.learners
        if cand.size == 0 or int(cap_all[cand].sum()) < n_learn:
            return None
        # A gang never needs more nodes than learners.
        max_nodes = min(job.max_nodes or n_learn, cand.size, n_learn)
        inf = np.inf
        # table[m, j]: cheapest cost of j learners on exactly m used nodes so far
        table = np.full((max_nodes + 1, n_learn + 1), inf)
        table[0, 0] = 0.0
        choice = np.zeros((cand.size, max_nodes + 1, n_learn + 1), dtype=np.int32)
        for pos, node in enumerate(cand):
            kmax = int(min(cap_all[node], n_learn))
            ks = np.arange(1, kmax + 1)
            node_cost = 1.0 + obj.leftover(cluster, job, np.full(kmax, node), ks)
            new = table.copy()
            for k, c in zip(ks, node_cost, strict=True):
                # place k learners here: from (m-1, j-k) to (m, j)
                cand_cost = np.full_like(table, inf)
                cand_cost[1:, k:] = table[:-1, : n_learn + 1 - k] + c
                better = cand_cost < new
                new = np.where(better, cand_cost, new)
                choice[pos][better] = k
            table = new
        m_best = int(np.argmin(table[:, n_learn]))
        if not np.isfinite(table[m_best, n_learn]):
            return None
        # walk back through the choices
        learners: list[int] = []
        m, j = m_best, n_learn
        for pos in range(cand.size - 1, -1, -1):
            took = int(choice[pos, m, j])
            if took:
                learners.extend([int(cand[pos])] * took)
                m, j = m - 1, j - took
        if j != 0:
            raise AssertionError("exact packing walk-back did not place every learner")
        learners.reverse()
        return Assignment(tuple(learners), float(table[m_best, n_learn]))
