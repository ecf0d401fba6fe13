"""The collector a learner controller starts batches a line-a-step learner's lines once a
second (issue #16): each batch costs the TDS, the search server and the collector CPU on
the cores the job's workers train on, and 1.0 s instead of 0.5 s cut a running pipeline
job's platform cost from 0.048 to 0.040 CPU s per second while a line stays searchable
within 2 s of its print (benchmarks/RESULTS.md, sessions 11 and 12)."""

from __future__ import annotations

import inspect

from learner.controller import controller
from learner.controller.collector import FLUSH_INTERVAL_S, Collector


def test_a_learner_s_lines_wait_up_to_a_second_for_their_batch() -> None:
    default = inspect.signature(Collector).parameters["flush_interval_s"].default
    assert default == FLUSH_INTERVAL_S == 1.0
    # the controller starts its collector with that default (it passes no interval)
    assert "flush_interval_s" not in inspect.getsource(controller.Controller)
