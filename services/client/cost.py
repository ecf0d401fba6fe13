"""What a job has cost so far on its nodes, and what the spot simulator expects it to cost
to finish: `rhizome show` prints both, the dashboard's job page shows them.

Cost so far = the hours the job held its nodes × each node's `price_per_hour` from the
cluster config (the scheduler's `GetCluster`). A job holds its nodes from its placement
(PENDING) until it waits again or stops (QUEUED, HALTED, or an end), read from its
history. Each distinct node of its present placement is charged in full for every held
interval: a spot instance serves one job (the Spot/Bamboo model), and a resumed job placed
elsewhere is priced at its present nodes (the record keeps no past placements). A node
with no price (0) is named as not priced rather than counted as free.

The estimate to finish runs the spot simulator (services/sim, what `rhizome estimate`
runs) on the manifest's `estimate:` section with the steps still to do: the steps done are
the newest step the job reported (its last metrics or checkpoints), and the preemption
model is a bundled trace (`DEFAULT_TRACE`), under the adaptive checkpointing strategy the
learners use.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

# Where a job holds no node: waiting to be placed, halted, or ended.
_NOT_HOLDING = {"QUEUED", "HALTED", "COMPLETED", "FAILED", "DELETED"}
DEFAULT_TRACE = "aws-p3-64.csv"
ESTIMATE_RUNS = 5
ESTIMATE_STRATEGY = "adaptive"


@dataclass(frozen=True)
class CostSoFar:
    held_hours: float  # wall-clock hours the job held its nodes
    node_hours: float  # held_hours × distinct nodes
    dollars: float  # over the priced nodes
    unpriced: list[str] = field(default_factory=list)  # nodes with no price_per_hour

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class FinishEstimate:
    steps_done: int
    steps_total: int
    dollars: float  # expected, to finish the remaining steps
    hours: float
    strategy: str
    model: str  # the preemption model the simulator used
    problem: str = ""  # why there is no estimate (a missing manifest field), else ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def held_seconds(history: Iterable[tuple[str, float]], now: float) -> float:
    """Seconds spent in states that hold nodes; `history` is (status, time), oldest first."""
    total, since = 0.0, None
    for status, at in history:
        holding = status not in _NOT_HOLDING
        if holding and since is None:
            since = at
        elif not holding and since is not None:
            total += max(0.0, at - since)
            since = None
    if since is not None:
        total += max(0.0, now - since)
    return total


def cost_so_far(
    history: Iterable[tuple[str, float]],
    nodes: Iterable[str],
    prices: Mapping[str, float],
    now: float,
) -> CostSoFar:
    distinct = sorted(set(nodes))
    hours = held_seconds(history, now) / 3600.0
    priced = [n for n in distinct if prices.get(n, 0.0) > 0]
    return CostSoFar(
        held_hours=hours,
        node_hours=hours * len(distinct),
        dollars=hours * sum(prices[n] for n in priced),
        unpriced=[n for n in distinct if n not in priced],
    )


def steps_done(
    last_metrics: Sequence[Mapping[str, Any]], checkpoints: Sequence[Mapping[str, Any]]
) -> int:
    """The newest step the job reported, from its last metrics and its checkpoints."""
    steps = [int(m.get("step", 0)) for m in last_metrics]
    steps += [int(c.get("step", 0)) for c in checkpoints]
    return max(steps, default=0)


def estimate_to_finish(
    manifest: Mapping[str, Any], done: int, trace: str = DEFAULT_TRACE
) -> FinishEstimate:
    """The simulator's expected cost and time of the steps left, under the adaptive
    strategy; a manifest without the needed `estimate:` fields gets `problem` set."""
    import click

    from services.sim.cli import build_inputs, manifest_fields
    from services.sim.model import SimInputError
    from services.sim.runner import simulate
    from services.sim.strategies import RedundancyParams, factories

    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "manifest.yml"
            path.write_text(yaml.safe_dump(dict(manifest)))
            base = manifest_fields(path)
        total = int(base.get("steps") or 0)
        if total < 1:
            return FinishEstimate(done, 0, 0.0, 0.0, ESTIMATE_STRATEGY, "", _NO_STEPS)
        left = max(0, total - done)
        if left == 0:
            return FinishEstimate(done, total, 0.0, 0.0, ESTIMATE_STRATEGY, "")
        job, model, prices = build_inputs({**base, "steps": left}, {"trace": trace})
        strategies = factories([ESTIMATE_STRATEGY], intervals=[], redundancy=RedundancyParams())
        rows = simulate(job, model, prices, strategies, runs=ESTIMATE_RUNS, seed=0)
    except click.ClickException as exc:
        return FinishEstimate(done, 0, 0.0, 0.0, ESTIMATE_STRATEGY, "", exc.format_message())
    except (SimInputError, ValueError) as exc:
        return FinishEstimate(done, 0, 0.0, 0.0, ESTIMATE_STRATEGY, "", str(exc))
    row = rows[0]
    return FinishEstimate(done, total, row.cost, row.time_h, row.strategy, model.label)


_NO_STEPS = (
    "no estimate: the manifest has no estimate.steps (add an estimate: section with "
    "steps, step_time, save_time and prices, as `rhizome estimate` reads)"
)


_TERMINAL = {"COMPLETED", "FAILED", "DELETED"}


def for_job(client: Any, job: Any) -> dict[str, Any]:
    """`rhizome show`'s cost figures of a `rhizome.v1.Job`: `cost_so_far` (None when the
    scheduler cannot say) and `estimate_to_finish` (None for an ended job)."""
    from google.protobuf import json_format
    from rhizome.v1 import job_pb2

    from services.client.sdk import ClientError

    try:
        prices: dict[str, float] | None = {n.name: n.price_per_hour for n in client.cluster().nodes}
    except ClientError:
        prices = None
    now = time.time()
    history = [
        (job_pb2.JobStatus.Name(h.status), h.time.ToMicroseconds() / 1e6) for h in job.history
    ]
    nodes = list(job.placement.learner_nodes.values())
    out: dict[str, Any] = {
        "cost_so_far": None
        if prices is None
        else cost_so_far(history, nodes, prices, now).to_dict(),
        "estimate_to_finish": None,
    }
    if job_pb2.JobStatus.Name(job.status) not in _TERMINAL:
        metrics = [{"step": m.step} for m in job.last_metrics]
        saves = [{"step": c.step} for c in job.checkpoints]
        manifest = json_format.MessageToDict(job.manifest)
        out["estimate_to_finish"] = estimate_to_finish(
            manifest, steps_done(metrics, saves)
        ).to_dict()
    return out
