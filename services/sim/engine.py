"""The event engine every strategy shares.

A run is a heap of timed events. The engine owns the market (the stream of candidate
preemptions with their notices), the job's progress, checkpoints and restarts, and the
time accounting; a strategy only reacts to hooks (`on_running`, `on_notice`,
`on_preempt`, `on_alloc`, `on_timer`, `on_commit`) by calling engine actions
(`start_save`, `fail`, `pause`, `request_nodes`, `schedule`).

States of the job, and the accounting bucket each one's time goes to:

| state | meaning | bucket |
| --- | --- | --- |
| `running` | training; below the high-water mark it is recomputation | compute / recompute (+ redundancy when slowed) |
| `saving` | a blocking save (δ; an emergency save also waits for its backup β) | save |
| `waiting` | a restart waits for replacement nodes | allocation |
| `preparing` | nodes are there; boot, rendezvous, load the checkpoint | preparation |
| `paused` | the redundant runtime fails over or reconfigures, no restart | failover |
| `stopped` | saved after a notice, waiting for the preemption itself | allocation |
| `done` | all steps done | — |

Events are guarded: `token` changes whenever the job leaves the running state (stale
timers are dropped), `epoch` on every restart from a checkpoint (a backup still in
flight when the job fails never commits).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from services.sim.model import JobSpec, PreemptionModel, Prices

BUCKETS = ("compute", "recompute", "save", "allocation", "preparation", "failover", "redundancy")
_STATE_BUCKET = {
    "saving": "save",
    "waiting": "allocation",
    "preparing": "preparation",
    "paused": "failover",
    "stopped": "allocation",
}


@dataclass
class RunResult:
    strategy: str
    finished: bool
    time_s: float
    breakdown: dict[str, float]
    cost: float
    samples: int
    preemptions: int
    restarts: int
    failovers: int = 0
    saves: int = 0
    # Redundant computation only: preemptions that took a stage and its shadow together,
    # so the job went back to its last checkpoint.
    fatal_failures: int = 0
    # Whole steps the model holds at the end: all of them when finished; at the horizon,
    # what survives (work lost to a failure and not redone is not counted).
    steps_done: int = 0

    @property
    def samples_per_dollar(self) -> float:
        return self.samples / self.cost if self.cost > 0 else math.inf


@dataclass(order=True)
class _Event:
    time: float
    seq: int
    kind: str = field(compare=False)
    data: dict[str, Any] = field(compare=False, default_factory=dict)


class Strategy:
    """Base strategy: no saves, restart from the last checkpoint on every preemption."""

    name = "base"
    spot = True

    def bind(self, sim: Sim) -> None:
        self.sim = sim

    def on_start(self) -> None:
        return None

    def on_running(self) -> None:
        return None

    def on_notice(self, time_left_s: float) -> None:
        return None

    def on_preempt(self) -> None:
        sim = self.sim
        if sim.state in ("waiting", "preparing"):
            sim.request_nodes(1)
        else:
            sim.fail(1)

    def on_alloc(self, purpose: str) -> None:
        return None

    def on_timer(self, name: str, data: dict[str, Any]) -> None:
        return None

    def on_commit(self, step: float) -> None:
        return None


class Sim:
    """One seeded run of one strategy on one job under one preemption model."""

    def __init__(
        self,
        job: JobSpec,
        model: PreemptionModel | None,
        strategy: Strategy,
        prices: Prices,
        seed: int,
        *,
        max_time_factor: float = 20.0,
    ) -> None:
        self.job = job
        self.model = model if strategy.spot else None
        self.strategy = strategy
        self.prices = prices
        # Common random numbers: every strategy sees the same preemptions for a seed.
        self.market_rng = random.Random(seed)
        self.rng = random.Random(seed * 7919 + 17)
        self.max_time = job.ideal_s * max_time_factor
        self.now = 0.0
        self._heap: list[_Event] = []
        self._seq = 0
        self.acct = dict.fromkeys(BUCKETS, 0.0)
        self.state = "running"
        self._seg_start = 0.0
        self.progress = 0.0
        self.high = 0.0
        self.committed = 0.0
        self.speed = 1.0
        self.token = 0
        self.epoch = 0
        self.missing = 0
        self.run_since_save = 0.0
        self.preemptions = 0
        self.preemption_times: set[float] = set()
        self.restarts = 0
        self.failovers = 0
        self.fatal_failures = 0
        self.saves = 0
        self._candidates: Iterator[tuple[float, float]] | None = None
        strategy.bind(self)

    # -- scheduling ---------------------------------------------------------------
    def schedule(self, delay: float, kind: str, guard: str | None = None, **data: Any) -> None:
        if guard == "token":
            data["_token"] = self.token
        elif guard == "epoch":
            data["_epoch"] = self.epoch
        self._seq += 1
        heapq.heappush(self._heap, _Event(self.now + max(delay, 0.0), self._seq, kind, data))

    def _stale(self, ev: _Event) -> bool:
        if "_token" in ev.data and ev.data["_token"] != self.token:
            return True
        return "_epoch" in ev.data and ev.data["_epoch"] != self.epoch

    def _next_candidate(self) -> None:
        if self._candidates is None:
            return
        try:
            t, p = next(self._candidates)
        except StopIteration:
            return
        notice = self.model.notice_s if self.model else 0.0
        at = max(t - notice, self.now)
        self._seq += 1
        heapq.heappush(self._heap, _Event(at, self._seq, "notice", {"t": t, "p": p}))

    # -- accounting ---------------------------------------------------------------
    def settle(self) -> None:
        dt = self.now - self._seg_start
        if dt > 0:
            if self.state == "running":
                steps = dt * self.speed / self.job.step_s
                useful = steps * self.job.step_s
                redo = max(0.0, min(self.progress + steps, self.high) - self.progress)
                self.acct["recompute"] += redo * self.job.step_s
                self.acct["compute"] += useful - redo * self.job.step_s
                self.acct["redundancy"] += dt - useful
                self.progress = min(self.progress + steps, float(self.job.steps))
                self.high = max(self.high, self.progress)
                self.run_since_save += dt
            elif self.state in _STATE_BUCKET:
                self.acct[_STATE_BUCKET[self.state]] += dt
        self._seg_start = self.now

    def _set_state(self, state: str) -> None:
        self.settle()
        self.state = state
        self.token += 1

    # -- actions ------------------------------------------------------------------
    def enter_running(self) -> None:
        self._set_state("running")
        left = (self.job.steps - self.progress) * self.job.step_s / self.speed
        self.schedule(left, "done", guard="token")
        self.strategy.on_running()

    def set_speed(self, speed: float) -> None:
        if self.state == "running":
            self.settle()
            self.speed = speed
            self.enter_running()
        else:
            self.speed = speed

    def start_save(self, *, backup_blocks: bool = False, reason: str = "save") -> None:
        """Blocking save of the current progress; its backup commits β later in the
        background, or before training goes on when `backup_blocks`."""
        self._set_state("saving")
        self.saves += 1
        blocking = self.job.save_s + (self.job.backup_s if backup_blocks else 0.0)
        self.schedule(
            blocking,
            "save_done",
            guard="token",
            step=self.progress,
            blocks=backup_blocks,
            reason=reason,
        )

    def fail(self, nodes_lost: int) -> None:
        """Restart from the last committed checkpoint once `nodes_lost` nodes are back."""
        self._set_state("waiting")
        self.epoch += 1
        self.restarts += 1
        self.progress = self.committed
        self.run_since_save = 0.0
        self.request_nodes(nodes_lost)
        if self.missing == 0:
            self._prepare()

    def request_nodes(self, n: int, purpose: str = "restart") -> None:
        for _ in range(n):
            if purpose == "restart":
                self.missing += 1
            self.schedule(self.rng.uniform(*self.job.alloc_s), "alloc", purpose=purpose)
        if purpose == "restart" and self.state == "preparing":
            self._set_state("waiting")

    def _prepare(self) -> None:
        self._set_state("preparing")
        self.schedule(self.rng.uniform(*self.job.prep_s), "prepared", guard="token")

    def pause(self, seconds: float, then: str = "resume") -> None:
        self._set_state("paused")
        self.schedule(seconds, then, guard="token")

    def stop_until_preempted(self) -> None:
        self._set_state("stopped")

    # -- the loop -----------------------------------------------------------------
    def run(self) -> RunResult:
        if self.model is not None:
            self._candidates = self.model.candidates(self.market_rng, self.job.nodes)
            self._next_candidate()
        self.strategy.on_start()
        self.enter_running()
        finished = False
        while self._heap:
            ev = heapq.heappop(self._heap)
            if ev.time > self.max_time:
                self.now = self.max_time
                break
            self.now = ev.time
            if self._stale(ev):
                continue
            if self._dispatch(ev):
                finished = True
                break
        self.settle()
        nodes = self.job.nodes
        price = self.prices.spot_hr if self.strategy.spot else self.prices.on_demand_hr
        # A run cut at the horizon is paid for all its time but credited only with the
        # steps it trained, so a strategy that never finishes cannot show a good value.
        steps_done = self.job.steps if finished else math.floor(self.progress + 1e-9)
        return RunResult(
            strategy=self.strategy.name,
            finished=finished,
            time_s=self.now,
            breakdown=dict(self.acct),
            cost=self.now / 3600.0 * nodes * price,
            samples=steps_done * self.job.samples_per_step,
            preemptions=self.preemptions,
            restarts=self.restarts,
            failovers=self.failovers,
            saves=self.saves,
            fatal_failures=self.fatal_failures,
            steps_done=steps_done,
        )

    def _dispatch(self, ev: _Event) -> bool:
        kind, data = ev.kind, ev.data
        if kind == "done":
            self.settle()
            self.progress = float(self.job.steps)
            self.state = "done"
            return True
        if kind == "notice":
            self._next_candidate()
            if self.market_rng.random() < data["p"]:
                self.preemptions += 1
                self.preemption_times.add(data["t"])
                self.strategy.on_notice(data["t"] - self.now)
                self.schedule(data["t"] - self.now, "preempt")
        elif kind == "preempt":
            self.strategy.on_preempt()
        elif kind == "alloc":
            if data["purpose"] == "restart":
                self.missing = max(0, self.missing - 1)
                if self.missing == 0 and self.state == "waiting":
                    self._prepare()
            else:
                self.strategy.on_alloc(data["purpose"])
        elif kind == "prepared":
            self.enter_running()
        elif kind == "save_done":
            self.settle()
            self.run_since_save = 0.0
            if data["blocks"]:
                self._commit(data["step"])
            else:
                self.schedule(self.job.backup_s, "commit", guard="epoch", step=data["step"])
            if data["reason"] == "emergency":
                self.stop_until_preempted()
            else:
                self.enter_running()
        elif kind == "commit":
            self._commit(data["step"])
        else:
            self.strategy.on_timer(kind, data)
        return False

    def _commit(self, step: float) -> None:
        self.committed = max(self.committed, step)
        self.strategy.on_commit(step)
