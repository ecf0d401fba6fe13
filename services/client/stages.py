"""`rhizome show`'s pipeline-stage table: where each stage of a pipeline job runs, and
why there (its shadow's zone)."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format
from rhizome.v1 import job_pb2
from rich.console import Console
from rich.table import Table

from services.client.sdk import Client, ClientError

STAGE_COLUMNS = ("learner", "stage", "pipeline", "node", "zone", "why")


def stage_placement(
    learner_nodes: dict[int, str], zones: dict[str, str] | None, stages: int, pipelines: int
) -> list[dict[str, Any]]:
    """Where each stage of a pipeline job runs and why: stage s's shadow (the learner of
    stage s-1 of the same pipeline, which holds its replica) should be in another zone,
    so that one zone's preemption wave cannot take a stage and its shadow together
    (the scheduler's zone-aware placement). ``zones``: node -> zone, None if unknown."""
    all_zones = set(zones.values()) if zones else set()
    rows = []
    for rank in range(stages * pipelines):
        node = learner_nodes.get(rank, "?")
        stage, pipe = rank % stages, rank // stages
        shadow = pipe * stages + (stage - 1) % stages
        zone = zones.get(node, "?") if zones is not None else "?"
        shadow_zone = zones.get(learner_nodes.get(shadow, ""), "?") if zones is not None else "?"
        if stages == 1:
            why = "one stage: no shadow"
        elif zones is None:
            why = f"shadow: learner {shadow}; zones unknown (the scheduler did not answer)"
        elif zone != shadow_zone:
            why = f"zone-aware: its shadow, learner {shadow}, runs in zone {shadow_zone}"
        elif len(all_zones) < 2:
            why = f"its shadow, learner {shadow}, is in the same zone: the cluster has one zone"
        else:
            why = (
                f"its shadow, learner {shadow}, is in the same zone: no other zone had room "
                "when the job was placed"
            )
        rows.append(
            {
                "learner": rank,
                "stage": stage,
                "pipeline": pipe,
                "node": node,
                "zone": zone,
                "why": why,
            }
        )
    for rank in sorted(r for r in learner_nodes if r >= stages * pipelines):
        # `pipeline.standbys`: which slot one took over, the history says
        node = learner_nodes[rank]
        zone = zones.get(node, "?") if zones is not None else "?"
        rows.append(
            {
                "learner": rank,
                "stage": "standby",
                "pipeline": "-",
                "node": node,
                "zone": zone,
                "why": "waits for a lost slot (or took one over: see the history)",
            }
        )
    return rows


def stage_rows(client: Client, job: job_pb2.Job) -> list[dict[str, Any]]:
    """`stage_placement` of a placed pipeline job (empty for any other job)."""
    manifest = json_format.MessageToDict(job.manifest)
    pipeline = manifest.get("pipeline") or {}
    if not pipeline:
        return []
    stages, pipelines = int(pipeline.get("stages", 1)), int(pipeline.get("pipelines", 1))
    zones: dict[str, str] | None
    try:
        zones = {n.name: n.zone for n in client.cluster().nodes}
    except ClientError:
        zones = None
    nodes = {int(r): str(n) for r, n in job.placement.learner_nodes.items()}
    return stage_placement(nodes, zones, stages, pipelines)


def print_stage_table(out: Console, rows: list[dict[str, Any]]) -> None:
    table = Table(*STAGE_COLUMNS, title="pipeline stages")
    for row in rows:
        table.add_row(*(str(row[k]) for k in STAGE_COLUMNS))
    out.print(table)
