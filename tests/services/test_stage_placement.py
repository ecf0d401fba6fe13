"""`rhizome show`'s pipeline-stage table: where each stage runs and why (unit)."""

from __future__ import annotations

from services.client.stages import stage_placement


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
