"""What the pages show of a job's recorded last metrics, checkpoints and cost
(services/dashboard/views.py), without a server."""

from __future__ import annotations

import json

from services.dashboard.views import job_view, with_cost, with_zones
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


def test_a_pipeline_learner_that_took_a_slot_shows_the_stage_it_serves_not_standby() -> None:
    # 2 stages x 1 pipeline, two standbys (learners 2 and 3) and a replacement (learner 1's
    # new incarnation); the history lines are the guardian's (services/guardian/pipeline.py)
    job = JobRecord(
        job_id="job-p",
        owner="alice",
        name="p",
        manifest={
            "name": "p",
            "framework": {"command": "python train.py"},
            "pipeline": {"stages": 2, "pipelines": 1, "standbys": 2, "max_pipelines": 2},
            "learners": 2,
        },
        resources={"learners": 4},
        status="PROCESSING",
        history=[
            StatusEntry("PROCESSING", 1.0),
            StatusEntry(
                "PROCESSING",
                2.0,
                "learner 1 preempted; stage 1 now served by learner 0 (generation 1)",
            ),
            StatusEntry(
                "PROCESSING",
                3.0,
                "standby learner 3 took over stage 1 of pipeline "
                "0 (learner 1's slot) without a cold start, every block has a "
                "replica (generation 2)",
            ),
        ],
        placement={"learner_nodes": {str(r): f"n{r}" for r in range(4)}},
    )
    zones = {f"n{r}": "z-a" if r % 2 == 0 else "z-b" for r in range(4)}
    rows = {r["learner"]: r for r in with_zones(job_view(job, now=4.0), job, zones)["stages"]}
    assert (rows[3]["stage"], rows[3]["pipeline"]) == (1, 0)
    assert rows[3]["why"] == "standby serving learner 1's slot"
    # learner 1's slot is learner 3's now: its replacement waits as a standby, and stage
    # 0's shadow (the learner serving stage 1) is learner 3
    assert rows[1]["stage"] == "standby"
    assert rows[2]["stage"] == "standby" and rows[2]["why"] == "waits for a lost slot"
    assert rows[0]["why"] == "zone-aware: its shadow, learner 3, runs in zone z-b"
    # a D+1 growth: the two queued standbys became pipeline 1
    job.history.append(
        StatusEntry(
            "PROCESSING",
            5.0,
            "pipeline grown to 2 pipelines: learners 1, 2 took "
            "slots 2, 3 (stages 0..1 of pipeline 1) from the queued standbys, "
            "without a cold start (generation 3)",
        )
    )
    rows = {r["learner"]: r for r in with_zones(job_view(job, now=6.0), job, zones)["stages"]}
    assert [(rows[r]["stage"], rows[r]["pipeline"]) for r in (0, 1, 2, 3)] == [
        (0, 0),
        (0, 1),
        (1, 1),
        (1, 0),
    ]
    assert rows[2]["why"] == "joined by growth: slot 3"
    assert "standby" not in [r["stage"] for r in rows.values()]
