"""Statistics shared by the benchmarks that compare two configurations over interleaved
rounds (security_overhead.py, overhead.py): a round's ratio is taken back to back, so the
median of the rounds' ratios and its confidence interval hold on a noisy shared machine
where an absolute figure does not."""

from __future__ import annotations

import math
import statistics


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """Lower quartile, median, upper quartile (inclusive method: defined for 2+ values)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    low, mid, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, mid, high


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval of the median (order statistics: the number
    of rounds below the true median is Binomial(n, 1/2)); it narrows as rounds are added,
    where the quartiles, the rounds' own spread, do not."""
    ordered = sorted(values)
    n = len(ordered)
    tail = (1 - confidence) / 2
    # the largest k with P(Binomial(n, 1/2) < k) <= tail: [x_(k), x_(n-k+1)], 1-based
    k, below = 0, 0.0
    while k < n:
        below_next = below + math.comb(n, k) / 2**n
        if below_next > tail:
            break
        below, k = below_next, k + 1
    if k == 0:  # too few rounds for this confidence: the whole range
        return ordered[0], ordered[-1]
    return ordered[k - 1], ordered[n - k]


def verdict(low: float, high: float, goal: float) -> str:
    """Met when even the upper end of the median's confidence interval is within the goal,
    missed when even its lower end is beyond it; otherwise the run does not resolve it."""
    if high <= goal:
        return "MET"
    if low > goal:
        return "MISSED"
    return "UNRESOLVED (the interval straddles the goal: more rounds, or a quieter machine)"
