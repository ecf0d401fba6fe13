"""BSA: the Biased Sampling Algorithm of FfDL §3.5, with PACK or SPREAD objectives.

Learners are logical entities, nodes physical ones. One placement decision:

1. **Filter**: nodes of the job's GPU type and labels with room for at least one
   learner; interchangeable nodes are collapsed to the few that matter
   (``objective.candidate_classes``), which is what keeps 10,000 nodes cheap.
2. **Rank → bias**: each candidate gets a score (PACK: cost per learner hosted when the
   node takes as much of the gang as it can — nodes that end up fullest and hold more
   of the gang rank first; SPREAD: how full one learner leaves it) and a sampling
   weight ``exp(-beta · (score - best))``.
3. **Sample** whole-gang assignments: a sample is a biased random order of the nodes
   (Gumbel top-k on the log-weights, one matrix operation for all samples) filled in
   that order — PACK fills each node as far as the gang allows, SPREAD deals learners
   one per node round robin, zone-aware jobs cap each zone at half the gang.
   The first sample of the first round is the ranking itself.
4. **Keep the best feasible** sample by the objective (ties: first drawn).
5. **Refine**: nodes used by the elite samples get more weight; repeat for a few rounds.

Deterministic for a given ``numpy.random.Generator`` state: no set iteration, stable sorts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.scheduler.api import Assignment, JobRequest, PlacementPolicy
from services.scheduler.cluster import Cluster
from services.scheduler.placement import objective as obj


def fill_pack(caps: np.ndarray, learners: int) -> np.ndarray:
    """Each row: nodes in order, each filled with as many learners as fit and remain."""
    before = np.cumsum(caps, axis=-1) - caps
    return np.clip(learners - before, 0, caps)


def fill_spread(caps: np.ndarray, learners: int) -> np.ndarray:
    """Each row: one learner per node in order, round after round, until all are dealt."""
    counts = np.zeros_like(caps)
    remaining = np.full(caps.shape[:-1], learners, dtype=np.int64)
    while np.any(remaining > 0):
        avail = counts < caps
        take = avail & (np.cumsum(avail, axis=-1) <= remaining[..., None])
        got = take.sum(axis=-1)
        if not np.any(got):
            break  # rows without room: the caller checks that the total capacity suffices
        counts += take
        remaining -= got
    return counts


def fill_zoned(caps: np.ndarray, zones: np.ndarray, learners: int, *, spread: bool) -> np.ndarray:
    """One row: like fill_pack/fill_spread, but no zone takes more than half the gang.

    If the budget cannot place everyone, a second pass places the rest anyway (zone
    conflicts then show up in the cost rather than leaving the job unplaced).
    """
    counts = np.zeros_like(caps)
    budget = max(1, learners // 2)
    per_zone: dict[int, int] = {}
    remaining = learners
    for respect_budget in (True, False):
        progressed = True
        while remaining > 0 and progressed:
            progressed = False
            for i in range(caps.size):
                if remaining == 0:
                    break
                z = int(zones[i])
                room = int(caps[i] - counts[i])
                if respect_budget:
                    room = min(room, budget - per_zone.get(z, 0))
                if spread:
                    room = min(room, 1)
                take = min(room, remaining)
                if take > 0:
                    counts[i] += take
                    per_zone[z] = per_zone.get(z, 0) + take
                    remaining -= take
                    progressed = True
            if not spread:
                break
    return counts


def best_fit_tail(
    cluster: Cluster, job: JobRequest, idx: np.ndarray, caps: np.ndarray, counts: np.ndarray
) -> np.ndarray:
    """Repair each sample: move the learners of its last node to the unused node they fill best.

    Greedy filling leaves the tail of the gang wherever the order happens to put it;
    a node that the tail fills exactly is usually further down the order.
    """
    used = counts > 0
    rows = np.arange(counts.shape[0])
    last = counts.shape[1] - 1 - np.argmax(used[:, ::-1], axis=1)
    k_last = counts[rows, last]
    pos = np.arange(counts.shape[1])
    ok = (pos[None, :] > last[:, None]) & (caps >= k_last[:, None])
    left = obj.leftover(cluster, job, idx, np.broadcast_to(k_last[:, None], counts.shape))
    current = left[rows, last]
    alt_score = np.where(ok, left, np.inf)
    alt = np.argmin(alt_score, axis=1)
    better = alt_score[rows, alt] < current - 1e-12
    if np.any(better):
        counts = counts.copy()
        r = rows[better]
        counts[r, last[better]] = 0
        counts[r, alt[better]] = k_last[better]
    return counts


@dataclass
class BsaPolicy(PlacementPolicy):
    objective: str = "pack"
    samples: int = 24
    rounds: int = 3
    elite_frac: float = 0.25
    learning_rate: float = 0.6
    beta: float = 4.0
    # Sort only each sample's useful prefix (`_top_order`); off = whole rows, as before
    # (kept for benchmarks/scheduler_placement.py's comparison).
    prefix_cut: bool = True

    def __post_init__(self) -> None:
        if self.objective not in ("pack", "spread"):
            raise ValueError(f"objective must be 'pack' or 'spread', not {self.objective!r}")
        self.name = self.objective

    # -- pieces ------------------------------------------------------------------------

    def _scores(
        self, cluster: Cluster, job: JobRequest, idx: np.ndarray, cap: np.ndarray
    ) -> np.ndarray:
        if self.objective == "pack":
            k = np.minimum(cap, job.learners)
            left = obj.leftover(cluster, job, idx, k)
            return (1.0 + left) * job.learners / np.maximum(k, 1)
        return 1.0 - obj.leftover(cluster, job, idx, np.ones_like(cap))

    def _fill(self, caps: np.ndarray, job: JobRequest) -> np.ndarray:
        if self.objective == "pack":
            return fill_pack(caps, job.learners)
        return fill_spread(caps, job.learners)

    def _cost(
        self, cluster: Cluster, job: JobRequest, idx: np.ndarray, counts: np.ndarray
    ) -> np.ndarray:
        if self.objective == "pack":
            return obj.pack_cost(cluster, job, idx, counts)
        return obj.spread_cost(cluster, job, idx, counts)

    # -- the algorithm -----------------------------------------------------------------

    def place(
        self, cluster: Cluster, job: JobRequest, rng: np.random.Generator
    ) -> Assignment | None:
        cap_all = cluster.capacity(job)
        cand = obj.candidate_classes(cluster, job, cap_all, per_node_one=self.objective == "spread")
        if cand.size == 0 or int(cap_all[cand].sum()) < job.learners:
            return None
        cap = cap_all[cand]
        score = self._scores(cluster, job, cand, cap)
        # Candidates sorted by rank (stable on node index) so that row 0 = the ranking.
        rank = np.lexsort((cand, score))
        cand, cap, score = cand[rank], cap[rank], score[rank]
        k_nodes = cand.size
        zones = cluster.zone_id[cand]
        zoned = job.zone_aware and job.learners >= 2 and np.unique(zones).size >= 2
        logw = -self.beta * (score - score[0])
        n_elite = max(1, round(self.samples * self.elite_frac))
        best: tuple[float, np.ndarray, np.ndarray] | None = None
        lower_bound = self._lower_bound(cap, job)
        for rnd in range(self.rounds):
            keys = logw[None, :] + rng.gumbel(size=(self.samples, k_nodes))
            if rnd == 0:
                # the ranking itself, and configuration order (what first-fit would do)
                keys[0] = -np.arange(k_nodes, dtype=np.float64)
                if self.samples > 1:
                    keys[1] = -np.argsort(np.argsort(cand, kind="stable"), kind="stable")
            order = (
                self._top_order(keys, job.learners)
                if self.prefix_cut
                else np.argsort(-keys, axis=1, kind="stable")
            )
            idx = cand[order]
            caps = cap[order]
            if zoned:
                counts = np.stack(
                    [
                        fill_zoned(
                            caps[s],
                            zones[order[s]],
                            job.learners,
                            spread=self.objective == "spread",
                        )
                        for s in range(self.samples)
                    ]
                )
            else:
                counts = self._fill(caps, job)
                if self.objective == "pack":
                    counts = best_fit_tail(cluster, job, idx, caps, counts)
            cost = self._cost(cluster, job, idx, counts)
            placed = counts.sum(axis=1) == job.learners
            cost = np.where(placed, cost, np.inf)
            if job.max_nodes is not None:
                cost = np.where((counts > 0).sum(axis=1) <= job.max_nodes, cost, np.inf)
            if zoned:
                conflicts = np.array(
                    [self._conflicts(cluster, idx[s], counts[s]) for s in range(self.samples)]
                )
                cost = cost + obj.zone_weight(job) * conflicts
            s_best = int(np.argmin(cost))
            if np.isfinite(cost[s_best]) and (best is None or cost[s_best] < best[0]):
                best = (float(cost[s_best]), idx[s_best], counts[s_best])
            if best is not None and best[0] <= lower_bound + 1e-9:
                break
            elite = np.argsort(cost, kind="stable")[:n_elite]
            elite = elite[np.isfinite(cost[elite])]
            if elite.size == 0:
                continue
            freq = np.zeros(k_nodes)
            np.add.at(freq, order[elite].ravel(), (counts[elite] > 0).ravel().astype(np.float64))
            freq /= freq.sum()
            w = np.exp(logw - logw.max())
            w /= w.sum()
            w = (1.0 - self.learning_rate) * w + self.learning_rate * freq
            logw = np.log(w + 1e-12)
        if best is None:
            return None
        cost_value, idx_row, count_row = best
        learners = [int(i) for i, k in zip(idx_row, count_row, strict=True) for _ in range(int(k))]
        n_conflicts = 0
        if zoned:
            learners = obj.arrange_by_zone(learners, cluster.zone_id)
            n_conflicts = obj.ring_conflicts([int(cluster.zone_id[i]) for i in learners])
        return Assignment(tuple(learners), cost_value, n_conflicts)

    @staticmethod
    def _top_order(keys: np.ndarray, learners: int) -> np.ndarray:
        """Each sample's nodes by descending key, cut to the first ``2L + 32``.

        A gang of L fits on its first L nodes (every candidate takes at least one
        learner), so only a prefix of each order is ever filled; the spare room is for
        ``best_fit_tail``'s search and SPREAD/zone budgets. Where nodes do not collapse
        into a few classes (mixed node sizes: hundreds of candidates), sorting whole rows
        was most of a decision's time; a partition first leaves a short sort.
        """
        m = min(keys.shape[1], 2 * learners + 32)
        if m == keys.shape[1]:
            return np.argsort(-keys, axis=1, kind="stable")
        top = np.argpartition(-keys, m - 1, axis=1)[:, :m]
        within = np.argsort(-np.take_along_axis(keys, top, axis=1), axis=1, kind="stable")
        return np.take_along_axis(top, within, axis=1)

    def _lower_bound(self, cap: np.ndarray, job: JobRequest) -> float:
        """No PACK placement costs less than the fewest nodes that could hold the gang."""
        if self.objective != "pack":
            return -np.inf
        top = np.sort(cap)[::-1]
        return float(np.searchsorted(np.cumsum(top), job.learners) + 1)

    @staticmethod
    def _conflicts(cluster: Cluster, idx: np.ndarray, counts: np.ndarray) -> int:
        learners = [int(i) for i, k in zip(idx, counts, strict=True) for _ in range(int(k))]
        arranged = obj.arrange_by_zone(learners, cluster.zone_id)
        return obj.ring_conflicts([int(cluster.zone_id[i]) for i in arranged])
