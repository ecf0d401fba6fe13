"""`rhizome show`'s pipeline-stage table: where each stage of a pipeline job runs, and
why there (its shadow's zone)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from google.protobuf import json_format
from rhizome.v1 import job_pb2
from rich.console import Console
from rich.table import Table

from services.client.sdk import Client, ClientError

STAGE_COLUMNS = ("learner", "stage", "pipeline", "node", "zone", "why")

# The guardian's history lines (services/guardian/pipeline.py, `note_growth` and
# `replace_lost`) that say a learner beyond P x D took a slot: the client has no etcd, and
# the history is what the platform records of who serves what.
_GROWN = re.compile(r"^pipeline grown to \d+ pipelines: learners ([\d, ]+) took slots ([\d, ]+) ")
_TOOK_OVER = re.compile(
    r"^standby learner (\d+) took over stage \d+ of pipeline \d+ \(learner (\d+)'s slot\)"
)


def slots_taken(history: Iterable[str]) -> dict[int, int]:
    """learner -> the slot it serves, for learners beyond the manifest's shape that took
    one (a growth's new pipeline, or a standby that took a lost slot), from the history's
    messages in order (a later line wins: a slot lost again and taken by another)."""
    taken: dict[int, int] = {}
    for message in history:
        if m := _GROWN.match(message):
            learners = [int(x) for x in m.group(1).split(",") if x.strip()]
            slots = [int(x) for x in m.group(2).split(",") if x.strip()]
            pairs = list(zip(learners, slots, strict=False))
        elif m := _TOOK_OVER.match(message):
            pairs = [(int(m.group(1)), int(m.group(2)))]
        else:
            continue
        for learner, slot in pairs:
            for other in [k for k, v in taken.items() if v == slot]:
                del taken[other]
            taken[learner] = slot
    return taken


def stage_placement(
    learner_nodes: dict[int, str],
    zones: dict[str, str] | None,
    stages: int,
    pipelines: int,
    taken: dict[int, int] | None = None,
) -> list[dict[str, Any]]:
    """Where each stage of a pipeline job runs and why: stage s's shadow (the learner of
    stage s-1 of the same pipeline, which holds its replica) should be in another zone,
    so that one zone's preemption wave cannot take a stage and its shadow together
    (the scheduler's zone-aware placement). ``zones``: node -> zone, None if unknown.
    ``taken``: learner -> slot for learners that serve a slot other than their own
    (`slots_taken` of the history): listed with that slot's stage and pipeline; a learner
    of the shape whose slot another took is listed as a standby."""
    all_zones = set(zones.values()) if zones else set()
    # slot -> the learner serving it: its own learner, unless the history says another
    # took it (a base learner whose slot a standby took is then a standby itself: its
    # replacement, a new incarnation of the rank, queues as one; docs/lifecycle.md)
    holder = {slot: slot for slot in range(stages * pipelines)}
    for learner, slot in (taken or {}).items():
        holder[slot] = learner
    rows = []
    for rank in range(stages * pipelines):
        node = learner_nodes.get(rank, "?")
        zone = zones.get(node, "?") if zones is not None else "?"
        slot = (taken or {}).get(rank, rank)
        if holder.get(slot) != rank:
            rows.append(_waiting(rank, node, zone, "waits for a lost slot (its own was taken)"))
            continue
        stage, pipe = slot % stages, slot // stages
        shadow_slot = pipe * stages + (stage - 1) % stages
        shadow = holder.get(shadow_slot, shadow_slot)
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
        node = learner_nodes[rank]
        zone = zones.get(node, "?") if zones is not None else "?"
        extra = (taken or {}).get(rank)
        if extra is not None:
            # a grown pipeline's learner, or a standby serving a lost slot (the history)
            grown = extra >= stages * pipelines
            rows.append(
                {
                    "learner": rank,
                    "stage": extra % stages,
                    "pipeline": extra // stages,
                    "node": node,
                    "zone": zone,
                    "why": (
                        f"joined by growth: slot {extra}"
                        if grown
                        else f"standby serving learner {extra}'s slot"
                    ),
                }
            )
            continue
        # `pipeline.standbys`: still waiting (the history names a slot once one is taken)
        rows.append(_waiting(rank, node, zone, "waits for a lost slot"))
    return rows


def _waiting(rank: int, node: str, zone: str, why: str) -> dict[str, Any]:
    """The row of a learner that serves no slot: a standby."""
    return {
        "learner": rank,
        "stage": "standby",
        "pipeline": "-",
        "node": node,
        "zone": zone,
        "why": why,
    }


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
    taken = slots_taken(event.message for event in job.history)
    return stage_placement(nodes, zones, stages, pipelines, taken)


def print_stage_table(out: Console, rows: list[dict[str, Any]]) -> None:
    table = Table(*STAGE_COLUMNS, title="pipeline stages")
    for row in rows:
        table.add_row(*(str(row[k]) for k in STAGE_COLUMNS))
    out.print(table)
