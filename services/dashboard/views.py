"""What the dashboard shows of a job: one plain dict, rendered by the templates and sent
as JSON to the page's scripts, so the first paint and the live updates agree."""

from __future__ import annotations

import math
from typing import Any

from services.store import states
from services.store.jobs import JobRecord


def duration(seconds: float) -> str:
    """`42s`, `3m 05s`, `2h 04m`, `3d 2h`: compact and readable."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def _since(job: JobRecord, status: str) -> float:
    """When the job last entered `status` (0 when it never did)."""
    for entry in reversed(job.history):
        if entry.status == status:
            return entry.time
    return 0.0


def phase(job: JobRecord, now: float) -> str:
    """How long the job has been in its present state, in words: what the jobs list shows."""
    since = _since(job, job.status) or job.updated_at or job.created_at
    if job.status == states.QUEUED:
        return f"queued {duration(now - since)}"
    if job.status in states.ACTIVE_STATES:
        started = _since(job, states.PROCESSING) or since
        return f"running {duration(now - started)}"
    return f"{job.status.lower()} {duration(now - since)} ago"


def _finite(metric: dict[str, Any]) -> float | None:
    """The value, or None for NaN and infinities (a diverged loss): JSON has no NaN, and
    the pages' JSON must parse."""
    value = float(metric.get("value", 0.0))
    return value if math.isfinite(value) else None


def last_metric_text(job: JobRecord, most: int = 2) -> str:
    """The jobs list's "last metric" cell: the most recently updated metrics, newest first,
    e.g. `loss 0.3124 · accuracy 0.91 (step 900)`; "" when the job emitted none."""
    newest = sorted(job.last_metrics, key=lambda m: -float(m.get("time", 0)))[:most]
    if not newest:
        return ""
    values = " · ".join(f"{m.get('name', '?')} {float(m.get('value', 0)):.4g}" for m in newest)
    return f"{values} (step {int(newest[0].get('step', 0))})"


def job_view(job: JobRecord, now: float, brief: bool = False) -> dict[str, Any]:
    res = job.resources
    view: dict[str, Any] = {
        "job_id": job.job_id,
        "name": job.name,
        "owner": job.owner,
        "status": job.status,
        "status_message": job.status_message,
        "queue_reason": job.queue_reason if job.status == states.QUEUED else "",
        "learners": int(res.get("learners", 1)),
        "gpus": float(res.get("gpus", 0)),
        "cpus": float(res.get("cpus", 1)),
        "memory_mb": float(res.get("memory_mb", 0)),
        "created_at": job.created_at,
        "phase": phase(job, now),
        "final": states.is_terminal(job.status),
        "can_halt": states.is_legal(job.status, states.HALTED),
        "can_resume": job.status == states.HALTED,
        "can_delete": states.is_legal(job.status, states.DELETED),
        "last_metric": last_metric_text(job),
        "last_metrics": [
            {**{k: m.get(k) for k in ("name", "step", "time", "learner")}, "value": _finite(m)}
            for m in job.last_metrics
        ],
    }
    elastic = job.spec.elastic
    view["elastic"] = {"min": elastic.min, "max": elastic.max} if elastic else None
    view["can_scale"] = elastic is not None and not states.is_terminal(job.status)
    if brief:
        return view
    # A queued job's record may still carry its previous placement (a resumed job).
    placed = job.placement if job.status != states.QUEUED else None
    nodes = (placed or {}).get("learner_nodes", {}) or {}
    view.update(
        history=[{"status": h.status, "time": h.time, "message": h.message} for h in job.history],
        placement=[
            {"learner": int(r), "node": str(n)}
            for r, n in sorted(nodes.items(), key=lambda kv: int(kv[0]))
        ],
        exit_code=job.exit_code,
        attempts=job.attempts,
        description=job.description,
        last_log_lines=list(job.last_log_lines),
        # Newest first, as the page's table lists them.
        checkpoints=[
            {k: c.get(k) for k in ("kind", "step", "size_bytes", "time", "learner", "name")}
            for c in reversed(job.checkpoints)
        ],
    )
    return view


def with_zones(
    view: dict[str, Any], job: JobRecord, zones: dict[str, str] | None
) -> dict[str, Any]:
    """The placement rows with each node's zone (`?` when the scheduler cannot say), and
    for a pipeline job its stages: which learner shadows which, and whether they sit in
    different zones (the CLI's `rhizome show` table, `stage_placement`). A learner that
    took a slot (a D+1 growth's new pipeline, or a standby admitted into a lost slot) is
    shown with the stage it serves, as the guardian wrote it into the history
    (services/guardian/pipeline.py): the dashboard reads the job record, not etcd, and the
    history is that record's account of who serves what."""
    from services.client.stages import slots_taken, stage_placement

    for row in view.get("placement", []):
        row["zone"] = (zones or {}).get(row["node"], "?")
    pipeline = job.spec.pipeline
    placed = {int(r["learner"]): str(r["node"]) for r in view.get("placement", [])}
    view["stages"] = (
        stage_placement(
            placed,
            zones,
            pipeline.stages,
            pipeline.pipelines,
            slots_taken(h.message for h in job.history),
        )
        if pipeline is not None and placed
        else []
    )
    return view


def with_cost(
    view: dict[str, Any], job: JobRecord, prices: dict[str, float] | None, now: float
) -> dict[str, Any]:
    """The job's cost so far (services/client/cost.py, as `rhizome show` prints it): its
    held node-hours at the nodes' prices; `cost` is None when the scheduler cannot say."""
    from services.client.cost import cost_so_far

    nodes = [str(n) for n in ((job.placement or {}).get("learner_nodes", {}) or {}).values()]
    history = [(h.status, h.time) for h in job.history]
    view["cost"] = None if prices is None else cost_so_far(history, nodes, prices, now).to_dict()
    return view
