"""The checkpoint-interval formula, shared because the platform's spot simulator
(services/sim) must model exactly what the learner's checkpoint policy
(learner/checkpoint/policy.py) does."""

from __future__ import annotations

import math


def daly_interval(save_s: float, mttp_s: float, restart_s: float) -> float:
    """τ_opt = sqrt(2·δ·(MTTP + R)), in seconds of training between saves (Daly's
    first-order optimum, with the restart time R added to the mean time to preemption
    as Spotify does)."""
    if save_s < 0 or mttp_s <= 0 or restart_s < 0:
        raise ValueError(
            f"daly_interval needs save_s >= 0, mttp_s > 0, restart_s >= 0; "
            f"got save_s={save_s}, mttp_s={mttp_s}, restart_s={restart_s}"
        )
    return math.sqrt(2.0 * save_s * (mttp_s + restart_s))
