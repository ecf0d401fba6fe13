"""The pipeline runtime's per-step metrics: one file the worker writes, one metric source
the platform reads it with.

A pipeline learner's runtime worker appends one JSON line per step it ends (or per
window of ``pipeline.metrics_every`` steps: the window's means, at its last step;
learner/runtime/step_metrics.py) to ``<job_dir>/learners/<rank>/runtime-metrics.jsonl``
(``RuntimeEnv.metrics_file``, set by ``RuntimeEnv.for_learner``); every pipeline job's
metric sources (``Manifest.metric_sources``) end with ``SOURCE``, an ``emetrics_file``
source on that file, so the learner's collector ships the lines like any metric:
``rhizome metrics JOB``, the REST gateway's ``/v1/models/{id}/metrics`` and the dashboard
show them, per learner (= worker = stage of its pipeline) and step. The lines are FfDL's
shape with the group ``runtime``, so the names cannot collide with the script's own
metrics:

| metric | what | when |
| --- | --- | --- |
| ``runtime/iter_ms`` | ms from the end of the previous step to the end of this one (a failover's pause lands here) | every step |
| ``runtime/generation`` | the configuration the step ended in (failovers and reconfigurations raise it) | every step |
| ``runtime/loss`` | the step's loss, summed over its microbatches | the last stage's workers |
| ``runtime/frc_bubble_ms`` | eager redundant forward (FRC) that ran while a message was awaited: free | eager FRC modes |
| ``runtime/frc_sync_ms`` | eager FRC left for the sync phase, with nothing awaited: on the critical path | eager FRC modes |
| ``runtime/frc_overrun_ms`` | eager FRC that ran past the arrival of the message whose wait it filled | eager FRC modes |
| ``runtime/frc_brc_ms`` | eager FRC run on demand before an eager BRC that needed its graph | eager FRC modes |

The four ``frc_*`` are learner/runtime/bubbles.py's ``PLACES`` (issue #24's claim that the
redundant forward runs in the bubbles, visible per stage and step).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

FILE = "runtime-metrics.jsonl"
GROUP = "runtime"
# the metric source of every pipeline job (learner/controller/metric_sources/emetrics_file.py;
# `in` is relative to the learner's directory)
SOURCE: Mapping[str, str] = {"type": "emetrics_file", "in": FILE}

ITER_MS = "iter_ms"
GENERATION = "generation"
LOSS = "loss"
# ms of eager FRC per place it ran, by learner/runtime/bubbles.py's place names
FRC_MS = {
    "bubble": "frc_bubble_ms",
    "sync": "frc_sync_ms",
    "overrun": "frc_overrun_ms",
    "brc": "frc_brc_ms",
}


def line(step: int, time_s: float, values: Mapping[str, float]) -> str:
    """One step's JSON line (FfDL's shape, group ``runtime``), newline-terminated."""
    return (
        json.dumps(
            {
                "meta": {"time": round(time_s * 1000.0, 3)},  # FfDL: milliseconds
                "grouplabel": GROUP,
                "etimes": {"step": {"type": 2, "value": step}},
                "values": {name: {"type": 3, "value": v} for name, v in values.items()},
            },
            separators=(",", ":"),
        )
        + "\n"
    )
