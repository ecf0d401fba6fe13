"""The strategies, registered by name (as SkyPilot's recovery strategies are):

- `on-demand`: on-demand nodes, never preempted, no saves.
- `checkpoint-restart`: spot; save every `interval_s` of training; on any preemption,
  wait for a replacement, prepare, resume from the last committed checkpoint.
- `adaptive` (Spotify): spot; on a notice with `T_step + δ + β < T_left`, train on while
  that stays safe (one step plus twice step + δ + β left), then finish the step, save,
  back up and stop until the preemption (nothing recomputed); otherwise insurance saves
  every `τ_opt = sqrt(2·δ·(MTTP + R))`, recomputed after every save from the platform's
  MTTP (learned online from the preemptions the job sees, starting from the platform's
  estimate for the instance type) and R.
- `redundant` (Bamboo): spot; every iteration pays the redundant-computation overhead; a
  lost node is covered by its predecessor after a failover pause and the job runs slower
  until a replacement arrives and the pipelines are reconfigured; losing two consecutive
  stages of one pipeline is fatal and restarts from the last checkpoint.

The redundant-computation parameters default to figures from the Bamboo paper where it
gives one (the 19.8 % eager-FRC/lazy-BRC overhead, BERT) and to stated assumptions
otherwise; replace them with the runtime's own benchmark figures when those exist.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from contract.policy import daly_interval
from contract.registry import Registry
from services.sim.engine import Strategy
from services.sim.model import JobSpec, PreemptionModel, SimInputError


@dataclass(frozen=True)
class RedundancyParams:
    """Bamboo's runtime, as the simulator models it."""

    # Per-iteration overhead of eager FRC + lazy BRC (Bamboo, BERT: 19.8 %; ResNet: 9.5 %).
    overhead: float = 0.198
    # Pause while the shadow takes over a lost stage (assumed; not a paper figure).
    failover_s: float = 10.0
    # Pause to reconfigure the pipelines when replacements have arrived (assumed).
    reconfig_s: float = 30.0
    # Slowdown while a shadow runs two stages (assumed: its backward over the replica).
    degraded_slowdown: float = 1.5
    # Checkpoint interval kept for fatal failures (assumed).
    checkpoint_every_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.overhead < 0 or self.failover_s < 0 or self.reconfig_s < 0:
            raise SimInputError("redundancy overhead, failover and reconfig must be >= 0")
        if self.degraded_slowdown < 1:
            raise SimInputError("degraded_slowdown must be >= 1 (1 = no slowdown)")
        if self.checkpoint_every_s <= 0:
            raise SimInputError("checkpoint_every_s must be > 0")


class OnDemand(Strategy):
    name = "on-demand"
    spot = False


class CheckpointRestart(Strategy):
    def __init__(self, interval_s: float, label: str | None = None) -> None:
        if not interval_s > 0:
            raise SimInputError(f"checkpoint interval must be > 0 seconds, got {interval_s}")
        self.interval_s = interval_s
        self.name = f"checkpoint-restart/{label or _fmt_interval(interval_s)}"

    def on_running(self) -> None:
        self.sim.schedule(self.interval_s - self.sim.run_since_save, "save_due", guard="token")

    def on_timer(self, name: str, data: dict[str, Any]) -> None:
        if name == "save_due" and self.sim.state == "running":
            self.sim.start_save(reason="periodic")


def platform_mttp_s(job: JobSpec, model: PreemptionModel) -> float:
    """The job's mean time to preemption as the platform estimates it before the job has
    seen one: 1 / (the model's preemption rate for a job of this many nodes)."""
    rate = model.job_rate_hr(job.nodes)
    return 3600.0 / rate if rate > 0 else 1e9


def daly_start_interval_s(job: JobSpec, model: PreemptionModel) -> tuple[float, float]:
    """(τ, MTTP): the Daly-optimal interval the adaptive policy starts from, and the MTTP
    it is computed from; the policy then learns MTTP from the preemptions it sees."""
    mttp = platform_mttp_s(job, model)
    return daly_interval(job.save_s, mttp, job.mean_restart_s), mttp


class Adaptive(Strategy):
    name = "adaptive"

    def __init__(self, platform_mttp_s: float | None = None) -> None:
        self.platform_mttp_s = platform_mttp_s
        self.notice_deadline: float | None = None
        self.emergency = False
        self.emergency_saves = 0
        self.insurance_saves = 0

    def on_start(self) -> None:
        sim = self.sim
        if self.platform_mttp_s is None:
            self.platform_mttp_s = platform_mttp_s(sim.job, sim.model) if sim.model else 1e9

    def mttp_s(self) -> float:
        # The platform's estimate counts as one observation; the job's own preemptions
        # pull it towards what this job sees.
        assert self.platform_mttp_s is not None
        seen = len(self.sim.preemption_times)
        return (self.platform_mttp_s + self.sim.now) / (1 + seen)

    def interval_s(self) -> float:
        return daly_interval(self.sim.job.save_s, self.mttp_s(), self.sim.job.mean_restart_s)

    def _fits(self, time_left: float) -> bool:
        job = self.sim.job
        return job.step_s / self.sim.speed + job.save_s + job.backup_s < time_left

    def insurance_needed(self) -> bool:
        notice = self.sim.model.notice_s if self.sim.model else 0.0
        return not self._fits(notice)

    def on_running(self) -> None:
        if self.notice_deadline is not None and self._try_emergency():
            return
        if self.insurance_needed():
            wait = self.interval_s() - self.sim.run_since_save
            self.sim.schedule(wait, "insurance_due", guard="token")

    def _try_emergency(self) -> bool:
        """Start the emergency save as late as safely possible (as the SDK does: while
        one step plus twice (step + δ + β) still fit, keep training)."""
        sim = self.sim
        if self.notice_deadline is None or self.emergency:
            return self.emergency
        if sim.state != "running":
            return False
        left = self.notice_deadline - sim.now
        if not self._fits(left):
            return False
        job = sim.job
        step = job.step_s / sim.speed
        start_in = left - (step + 2 * (step + job.save_s + job.backup_s))
        if start_in > 1e-9:
            sim.schedule(start_in, "emergency_start")
            return False
        sim.settle()
        to_boundary = (math.ceil(sim.progress - 1e-9) - sim.progress) * step
        self.emergency = True
        sim.schedule(to_boundary, "step_boundary", guard="token")
        return True

    def on_notice(self, time_left_s: float) -> None:
        deadline = self.sim.now + time_left_s
        if self.notice_deadline is None or deadline < self.notice_deadline:
            self.notice_deadline = deadline
        self._try_emergency()

    def on_preempt(self) -> None:
        self.notice_deadline = None
        self.emergency = False
        super().on_preempt()

    def on_timer(self, name: str, data: dict[str, Any]) -> None:
        sim = self.sim
        if name == "emergency_start":
            self._try_emergency()
        elif name == "step_boundary" and sim.state == "running":
            sim.settle()
            sim.progress = min(float(round(sim.progress)), float(sim.job.steps))
            self.emergency_saves += 1
            sim.start_save(backup_blocks=True, reason="emergency")
        elif name == "insurance_due" and sim.state == "running" and not self.emergency:
            self.insurance_saves += 1
            sim.start_save(reason="insurance")


class Redundant(Strategy):
    name = "redundant"

    def __init__(self, params: RedundancyParams | None = None) -> None:
        self.p = params or RedundancyParams()
        self.dead: set[tuple[int, int]] = set()
        self.standby = 0

    @property
    def base_speed(self) -> float:
        return 1.0 / (1.0 + self.p.overhead)

    def _speed(self) -> float:
        return self.base_speed / (self.p.degraded_slowdown if self.dead else 1.0)

    def on_start(self) -> None:
        self.sim.speed = self.base_speed

    def on_running(self) -> None:
        sim = self.sim
        wait = self.p.checkpoint_every_s - sim.run_since_save
        sim.schedule(wait, "save_due", guard="token")
        if self.dead and self.standby >= len(self.dead):
            self._reconfigure()

    def on_preempt(self) -> None:
        sim = self.sim
        if sim.state in ("waiting", "preparing"):
            sim.request_nodes(1)
            return
        job = sim.job
        alive = [
            (d, s)
            for d in range(job.pipelines)
            for s in range(job.stages)
            if (d, s) not in self.dead
        ]
        if not alive:
            sim.request_nodes(1)
            return
        d, s = alive[sim.rng.randrange(len(alive))]
        neighbours = {(d, (s - 1) % job.stages), (d, (s + 1) % job.stages)}
        if job.stages == 1 or neighbours & self.dead:
            # No shadow left for a stage: fatal, back to the last checkpoint.
            need = max(0, len(self.dead) + 1 - self.standby)
            self.dead.clear()
            self.standby = 0
            sim.settle()  # account the time so far at the old speed
            sim.speed = self.base_speed
            sim.fatal_failures += 1
            sim.fail(need)
            return
        self.dead.add((d, s))
        sim.failovers += 1
        sim.request_nodes(1, purpose="standby")
        sim.settle()
        sim.speed = self._speed()
        sim.pause(self.p.failover_s)

    def on_alloc(self, purpose: str) -> None:
        # A standby node also needs preparing before it can join.
        self.sim.schedule(self.sim.rng.uniform(*self.sim.job.prep_s), "standby_ready")

    def _reconfigure(self) -> None:
        sim = self.sim
        filled = min(self.standby, len(self.dead))
        for _ in range(filled):
            self.dead.pop()
        self.standby -= filled
        sim.settle()
        sim.speed = self._speed()
        sim.pause(self.p.reconfig_s)

    def on_timer(self, name: str, data: dict[str, Any]) -> None:
        sim = self.sim
        if name == "standby_ready":
            self.standby += 1
            if sim.state == "running" and self.dead and self.standby >= len(self.dead):
                self._reconfigure()
        elif name == "resume" and sim.state == "paused":
            sim.enter_running()
        elif name == "save_due" and sim.state == "running":
            sim.start_save(reason="periodic")


def _fmt_interval(s: float) -> str:
    if s >= 3600 and s % 3600 == 0:
        return f"{int(s // 3600)}h"
    if s >= 60 and s % 60 == 0:
        return f"{int(s // 60)}m"
    return f"{s:g}s"


StrategyFactory = Callable[[], Strategy]
# A checkpoint interval: seconds of training, and the label of its row (None: the
# seconds, written short such as 15m).
Interval = tuple[float, str | None]
# A strategy's name -> the factories it stands for, given the run's options.
StrategyBuilder = Callable[[list[Interval], RedundancyParams], list[StrategyFactory]]


def _on_demand(intervals: list[Interval], redundancy: RedundancyParams) -> list[StrategyFactory]:
    """On-demand nodes, never preempted."""
    return [OnDemand]


def _checkpoint_restart(
    intervals: list[Interval], redundancy: RedundancyParams
) -> list[StrategyFactory]:
    """Spot, save every fixed interval, restart from the last checkpoint (one per interval)."""
    if not intervals:
        raise SimInputError("checkpoint-restart needs at least one --interval")
    for seconds, _label in intervals:
        if not seconds > 0:
            raise SimInputError(f"checkpoint interval must be > 0 seconds, got {seconds:g}")
    return [
        lambda iv=iv, label=label: CheckpointRestart(iv, label)  # type: ignore[misc]
        for iv, label in intervals
    ]


def _adaptive(intervals: list[Interval], redundancy: RedundancyParams) -> list[StrategyFactory]:
    """Spot, emergency save on notice, Daly insurance saves otherwise (Spotify)."""
    return [Adaptive]


def _redundant(intervals: list[Interval], redundancy: RedundancyParams) -> list[StrategyFactory]:
    """Spot, redundant computation with failover and reconfiguration (Bamboo)."""
    return [lambda: Redundant(redundancy)]


# In the order the CLI runs them by default.
REGISTRY: Registry[StrategyBuilder] = Registry("strategy", error=SimInputError, ordered=True)
REGISTRY.register("on-demand", _on_demand)
REGISTRY.register("checkpoint-restart", _checkpoint_restart)
REGISTRY.register("adaptive", _adaptive)
REGISTRY.register("redundant", _redundant)


def factories(
    names: list[str],
    *,
    redundancy: RedundancyParams,
    intervals_s: list[float] | None = None,
    intervals: list[Interval] | None = None,
) -> list[StrategyFactory]:
    """One factory per simulated strategy; checkpoint-restart expands to one per interval
    (`intervals_s` in seconds, or labelled `intervals`)."""
    every = [*(intervals or []), *((s, None) for s in intervals_s or [])]
    out: list[StrategyFactory] = []
    for name in names:
        out.extend(REGISTRY.get(name)(every, redundancy))
    return out
