"""`train --wait`'s progress line from a job's metric samples (services/client/progress.py)."""

from __future__ import annotations

from rhizome.v1 import tds_pb2

from services.client.progress import format_eta, progress_of


def sample(learner: int, name: str, step: int, value: float, t: float) -> tds_pb2.MetricSample:
    s = tds_pb2.MetricSample(learner=learner, name=name, step=step, value=value)
    s.time.FromNanoseconds(int(t * 1e9))
    return s


def test_step_loss_and_eta_at_the_pace_so_far() -> None:
    samples = [
        sample(0, "total_steps", 1, 10, 100.0),
        sample(0, "loss", 1, 0.9, 100.0),
        sample(0, "loss", 3, 0.5, 104.0),  # 2 s per step
        sample(1, "loss", 7, 0.1, 105.0),  # another learner's samples are not mixed in
    ]
    now = progress_of(samples)
    assert now is not None
    assert (now.step, now.loss, now.total) == (3, 0.5, 10)
    assert now.eta_s == 14.0  # 7 steps left × 2 s
    assert now.line() == "step 3/10, loss 0.5, ETA 14s"


def test_no_eta_without_total_steps_and_nothing_before_a_step() -> None:
    assert progress_of([]) is None
    now = progress_of([sample(0, "accuracy", 2, 0.7, 1.0)])
    assert now is not None and now.line() == "step 2"


def test_eta_formats() -> None:
    assert [format_eta(s) for s in (0, 59, 61, 3600 * 2 + 60 * 5)] == [
        "0s",
        "59s",
        "1m01s",
        "2h05m",
    ]
