"""The step loop starts no thread per step (issue #24): blocks, filled receives and
sync-phase waits run on kept pool threads, and waits wake on events, not timers.

In-process workers (real gloo groups over a HashStore): every thread a worker starts is a
``threading.Thread.start`` of this process, counted here while the steps go by.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from learner.runtime.api import Batch, RedundancyMode
from learner.runtime.inprocess import run_in_process
from learner.runtime.toy import toy_batch, toy_job

# the figure: the thread count stays constant over 1,000 steps (2 microbatches
# keep a step short: the test is about threads, not the schedule's shape)
STEPS = 1000
MICROBATCHES = 2
WARM = 5


def _thread_starts_per_step(
    mode: RedundancyMode, monkeypatch: pytest.MonkeyPatch
) -> dict[int, int]:
    started = [0]
    real_start = threading.Thread.start

    def counting_start(self: threading.Thread) -> None:
        started[0] += 1
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", counting_start)
    seen: dict[int, int] = {}

    def batch(step: int, pipeline: int, microbatch: int) -> Batch:
        if microbatch == 0:
            seen.setdefault(step, started[0])  # threads started before this step began
        return toy_batch(step, pipeline, microbatch)

    job = toy_job(steps=STEPS, microbatches=MICROBATCHES, redundancy=mode)
    job.batch = batch
    run_in_process(job, stages=2, pipelines=1, poll_s=0.05)
    return seen


@pytest.mark.parametrize("mode", [RedundancyMode.NONE, RedundancyMode.LAZY_FRC_LAZY_BRC])
def test_no_thread_is_started_per_step(mode: RedundancyMode, monkeypatch: Any) -> None:
    seen = _thread_starts_per_step(mode, monkeypatch)
    assert seen[STEPS - 1] - seen[WARM] == 0, (
        f"{seen[STEPS - 1] - seen[WARM]} threads started over {STEPS - 1 - WARM} steps"
    )


def test_eager_frc_adds_at_most_one_kept_thread_per_worker(monkeypatch: Any) -> None:
    # the first receive that is filled with FRC needs a second pool thread on that
    # worker; when that happens depends on the bubble history, after that never again
    seen = _thread_starts_per_step(RedundancyMode.EAGER_FRC_LAZY_BRC, monkeypatch)
    assert seen[STEPS - 1] - seen[WARM] <= 2
