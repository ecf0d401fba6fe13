"""What the pages show of a job's recorded last metrics, checkpoints and cost
(services/dashboard/views.py), without a server."""

from __future__ import annotations

import json

from services.dashboard.views import job_view, with_cost
from services.store.jobs import JobRecord, StatusEntry


def record(**fields: object) -> JobRecord:
    return JobRecord(
        job_id="job-1",
        owner="alice",
        name="m",
        manifest={"name": "m", "framework": {"command": "true"}},
        resources={"learners": 1},
        **fields,  # type: ignore[arg-type]
    )


def test_the_row_shows_the_two_newest_metrics_and_a_diverged_loss_still_renders() -> None:
    job = record(
        last_metrics=[
            {"name": "acc", "value": 0.91, "step": 90, "time": 5.0, "learner": 0},
            {"name": "loss", "value": float("nan"), "step": 100, "time": 9.0, "learner": 0},
            {"name": "lr", "value": 0.1, "step": 10, "time": 1.0, "learner": 0},
        ]
    )
    view = job_view(job, now=10.0, brief=True)
    assert view["last_metric"] == "loss nan · acc 0.91 (step 100)"
    # JSON has no NaN: the live poll's body and the page's embedded view must parse.
    json.loads(json.dumps(view, allow_nan=False))
    assert {m["name"]: m["value"] for m in view["last_metrics"]}["loss"] is None


def test_the_job_view_lists_checkpoints_newest_first_and_prices_the_held_hours() -> None:
    job = record(
        status="PROCESSING",
        history=[StatusEntry("QUEUED", 0.0), StatusEntry("PENDING", 0.0)],
        placement={"learner_nodes": {"0": "gpu-a"}},
        checkpoints=[
            {"kind": "periodic", "step": 1, "size_bytes": 10, "time": 1.0, "learner": "0"},
            {"kind": "emergency", "step": 2, "size_bytes": 20, "time": 2.0, "learner": "0"},
        ],
    )
    view = with_cost(job_view(job, now=3600.0), job, {"gpu-a": 0.5}, now=3600.0)
    assert [c["kind"] for c in view["checkpoints"]] == ["emergency", "periodic"]
    assert view["cost"]["dollars"] == 0.5 and view["cost"]["node_hours"] == 1.0
    # The scheduler did not answer: no figure rather than a wrong one.
    assert with_cost(job_view(job, now=3600.0), job, None, now=3600.0)["cost"] is None
