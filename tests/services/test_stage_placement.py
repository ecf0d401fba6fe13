"""`rhizome show`'s pipeline-stage table: where each stage runs and why (unit)."""

from __future__ import annotations

from services.client.stages import slots_taken, stage_placement


def test_each_stage_names_its_shadow_and_the_zone_it_runs_in() -> None:
    zones = {"a1": "za", "b1": "zb", "a2": "za"}
    rows = stage_placement({0: "a1", 1: "b1", 2: "a2"}, zones, stages=3, pipelines=1)
    assert [(r["learner"], r["stage"], r["node"], r["zone"]) for r in rows] == [
        (0, 0, "a1", "za"),
        (1, 1, "b1", "zb"),
        (2, 2, "a2", "za"),
    ]
    assert rows[1]["why"] == "zone-aware: its shadow, learner 0, runs in zone za"
    # stage 0's shadow is the last stage (it holds block 0's replica): same zone here,
    # although the cluster has another
    assert rows[0]["why"].startswith("its shadow, learner 2, is in the same zone: no other zone")


def test_one_zone_one_stage_and_unknown_zones_are_said_as_such() -> None:
    one_zone = stage_placement({0: "n0", 1: "n1"}, {"n0": "z", "n1": "z"}, 2, 1)
    assert one_zone[1]["why"].endswith("the cluster has one zone")
    assert stage_placement({0: "n0"}, {"n0": "z"}, 1, 1)[0]["why"] == "one stage: no shadow"
    unknown = stage_placement({0: "n0", 1: "n1", 2: "n2", 3: "n3"}, None, 2, 2)
    assert unknown[3]["pipeline"] == 1 and unknown[3]["zone"] == "?"
    assert unknown[3]["why"].startswith("shadow: learner 2; zones unknown")


def test_a_grown_learner_and_a_standby_that_took_a_slot_show_the_slot_they_serve() -> None:
    # the guardian's own history lines (services/guardian/pipeline.py)
    history = [
        "learner 1 preempted; stage 1 now served by learner 0 (generation 1)",
        "standby learner 4 took over stage 1 of pipeline 0 (learner 1's slot) without a "
        "cold start, every block has a replica (generation 2)",
        "pipeline grown to 2 pipelines: learners 5, 6 took slots 2, 3 (stages 0..1 of "
        "pipeline 1) from the queued standbys, without a cold start (generation 3)",
    ]
    taken = slots_taken(history)
    assert taken == {4: 1, 5: 2, 6: 3}
    nodes = {r: f"n{r}" for r in range(8)}
    rows = {row["learner"]: row for row in stage_placement(nodes, None, 2, 1, taken)}
    assert (rows[5]["stage"], rows[5]["pipeline"]) == (0, 1)
    assert (rows[6]["stage"], rows[6]["pipeline"]) == (1, 1)
    assert rows[6]["why"] == "joined by growth: slot 3"
    assert (rows[4]["stage"], rows[4]["pipeline"]) == (1, 0)
    assert rows[7]["stage"] == "standby" and rows[7]["why"] == "waits for a lost slot"
    # a slot taken again by another learner is that learner's now
    again = slots_taken(
        [*history, "standby learner 7 took over stage 0 of pipeline 1 (learner 2's slot) x"]
    )
    assert again == {4: 1, 6: 3, 7: 2}
