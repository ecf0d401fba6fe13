"""The checkpoint policy as pure functions (Spotify, ARCHITECTURE §6).

- Emergency save is possible when the step in flight, a save and a backup all fit in the
  time the notice leaves: `T_step + δ + β < T_grace`. Then nothing is recomputed.
- Otherwise insurance saves every `τ_opt = sqrt(2·δ·(MTTP + R))` (Daly's first-order
  optimum, with the restart time R added to the mean time to preemption as Spotify does).
"""

from __future__ import annotations

from dataclasses import dataclass

# The formula lives in the contract: the platform's simulator models the same policy.
from contract.policy import daly_interval


def emergency_save_fits(step_s: float, save_s: float, backup_s: float, grace_s: float) -> bool:
    """True when finishing the current step, saving and backing up fits in the grace."""
    return step_s + save_s + backup_s < grace_s


@dataclass(frozen=True)
class Decision:
    """What `should_save` answered and why (kept for logs and tests)."""

    save: bool
    reason: str  # "emergency", "insurance", "periodic-soon", "not-due", "no-insurance"
    interval_s: float


def insurance_decision(
    *,
    since_last_save_s: float,
    step_s: float,
    save_s: float,
    backup_s: float,
    mttp_s: float,
    restart_s: float,
    grace_s: float,
    mode: str = "auto",
    next_periodic_in_s: float | None = None,
    interval_s: float | None = None,
) -> Decision:
    """Whether an insurance save is due now, at a step boundary.

    `mode="auto"` takes insurance saves only when an emergency save would not fit in the
    grace period (the notice then covers every preemption); `"always"` takes them anyway
    (for preemptions that come without notice); `"never"` relies on notices alone.
    An insurance save is skipped when the script's own periodic save will come within the
    next step: that save counts as the insurance save. `interval_s` replaces Daly's
    interval (the manifest's fixed policy).
    """
    tau = interval_s if interval_s is not None else daly_interval(save_s, mttp_s, restart_s)
    if mode == "never" or (
        mode == "auto" and emergency_save_fits(step_s, save_s, backup_s, grace_s)
    ):
        return Decision(False, "no-insurance", tau)
    if since_last_save_s < tau:
        return Decision(False, "not-due", tau)
    if next_periodic_in_s is not None and next_periodic_in_s <= step_s:
        return Decision(False, "periodic-soon", tau)
    return Decision(True, "insurance", tau)


__all__ = ["Decision", "daly_interval", "emergency_save_fits", "insurance_decision"]
