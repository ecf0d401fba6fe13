"""The bubble predictor: FRC goes where the previous step waited long enough, nowhere else."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from learner.runtime.api import RedundancyMode
from learner.runtime.bubbles import IN_BUBBLE, IN_SYNC, OVERRUN, BubblePredictor, FrcProfile
from learner.runtime.engine import WorkerOptions
from learner.runtime.inprocess import run_workers
from learner.runtime.interpreter import Interpreter
from learner.runtime.toy import toy_job


def test_nothing_fits_before_an_frc_was_measured() -> None:
    b = BubblePredictor()
    b.record_wait("recv", 1.0)
    assert not b.fits("recv", 0.0)
    assert not b.fits("recv", 0.0)


def test_frc_fits_only_where_it_ends_before_the_predicted_arrival() -> None:
    b = BubblePredictor(overrun=0.0)
    b.record_frc(0.010)
    b.record_wait("long", 0.025)
    b.record_wait("short", 0.004)
    assert b.fits("long", 0.0) and not b.fits("short", 0.0)
    assert b.fits("long", 0.0) and b.fits("long", 0.015)  # two FRCs of 10 ms in 25 ms
    assert not b.fits("long", 0.016)  # a third would make the arrival wait
    assert not b.fits("unseen", 0.0)


def test_predictions_are_medians_so_one_slow_step_does_not_move_them() -> None:
    b = BubblePredictor(wait_window=3, cost_window=3)
    for seconds in (0.030, 0.031, 0.200):  # the third step was slowed by something else
        b.record_wait("recv", seconds)
    assert b.predicted_wait("recv") == 0.031
    for seconds in (0.004, 0.003):  # the bubble moved away: stop filling here
        b.record_wait("recv", seconds)
    assert b.predicted_wait("recv") == 0.004
    for seconds in (0.010, 0.050, 0.012):
        b.record_frc(seconds)
    assert b.frc_cost == 0.012


def test_an_overrun_allowance_admits_a_fill_that_ends_a_little_late() -> None:
    strict, loose = BubblePredictor(overrun=0.0), BubblePredictor(overrun=0.5)
    for b in (strict, loose):
        b.record_frc(0.010)
        b.record_wait("recv", 0.007)
    assert not strict.fits("recv", 0.0)
    assert loose.fits("recv", 0.0) and not loose.fits("recv", 0.003)


def test_the_pipeline_fill_floor_holds_when_the_stage_measured_itself_late() -> None:
    b = BubblePredictor(overrun=0.1)
    b.record_frc(0.010)
    b.record_wait("first-recv", 0.002)  # it arrived late: the message was already there
    assert not b.fits("first-recv", 0.0)
    assert b.fits("first-recv", 0.0, floor_frcs=2) and b.fits("first-recv", 0.010, floor_frcs=2)
    assert not b.fits("first-recv", 0.012, floor_frcs=2)


@dataclass
class _Arrived:
    """What ``Interpreter._attribute`` reads of a receive: done, and when it finished."""

    finished_at: float
    done: threading.Event = field(default_factory=threading.Event)


def _attribute(span: tuple[float, float], arrived_at: float | None, late: str) -> dict[str, float]:
    interp = Interpreter.__new__(Interpreter)  # only its profile is used
    interp.frc_profile = FrcProfile()
    call = _Arrived(arrived_at or 0.0)
    if arrived_at is not None:
        call.done.set()
    interp._attribute(3, span, call, late)  # type: ignore[arg-type]
    return interp.frc_profile.per_step[3]


def test_frc_time_past_the_arrival_of_the_awaited_message_is_not_counted_in_the_bubble() -> None:
    row = _attribute((10.0, 10.5), 10.3, OVERRUN)
    assert abs(row[IN_BUBBLE] - 0.3) < 1e-9 and abs(row[OVERRUN] - 0.2) < 1e-9
    row = _attribute((10.0, 10.5), 9.0, IN_SYNC)  # already there: all on the critical path
    assert row[IN_BUBBLE] == 0.0 and abs(row[IN_SYNC] - 0.5) < 1e-9
    row = _attribute((10.0, 10.5), None, IN_SYNC)  # still awaited when the FRC ended
    assert abs(row[IN_BUBBLE] - 0.5) < 1e-9 and row[IN_SYNC] == 0.0


def test_the_bubble_share_counts_only_frc_time_inside_bubbles() -> None:
    profile = FrcProfile()
    profile.record(5, IN_BUBBLE, 0.3)
    profile.record(5, OVERRUN, 0.1)
    profile.record(5, IN_SYNC, 0.2)
    profile.record(1, IN_SYNC, 9.0)  # before first_step: not counted
    assert profile.bubble_share(first_step=2) == 0.5


def test_the_summary_line_gives_ms_per_step_in_each_place_and_the_share() -> None:
    profile = FrcProfile()
    assert profile.summary() is None  # no FRC ran: nothing to say
    profile.record(2, IN_BUBBLE, 0.030)
    profile.record(2, IN_SYNC, 0.010)
    profile.record(3, IN_BUBBLE, 0.010)
    profile.record(3, OVERRUN, 0.010)
    assert profile.summary() == (
        "eager FRC per step (steps 2-3): 20.0 ms in bubbles, 5.0 ms in the sync phase, "
        "5.0 ms past a message's arrival, 0.0 ms before an eager BRC (67 % in bubbles)"
    )


def _events_of_a_run(mode: RedundancyMode) -> list[list[str]]:
    """Two in-process workers (in-memory cluster state, gloo over a HashStore)."""
    job = toy_job(steps=4, microbatches=4, redundancy=mode)
    opts = [WorkerOptions(worker=w, stages=2, pipelines=1, verbose=False) for w in range(2)]
    return [worker.events for worker, _ in run_workers(job, opts)]


def test_every_eager_worker_logs_where_its_frc_ran_at_the_end_of_the_run() -> None:
    for events in _events_of_a_run(RedundancyMode.EAGER_FRC_LAZY_BRC):
        lines = [e for e in events if e.startswith("eager FRC per step")]
        assert len(lines) == 1 and lines[0].endswith("% in bubbles)"), events[-3:]
    for events in _events_of_a_run(RedundancyMode.NONE):
        assert not [e for e in events if e.startswith("eager FRC")]
