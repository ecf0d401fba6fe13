"""The TDS keeps each job's newest metric values on its record at a bounded rate
(services/tds/last_metrics.py): through a real gRPC TDS over the in-memory store, with a
recording writer in place of the jobs repository (its side: tests/services/store/
test_last_metrics_store.py)."""

from __future__ import annotations

from typing import Any

from rhizome.v1 import tds_pb2

from services.tds.api import create_store, set_time_us
from services.tds.last_metrics import LastMetrics
from tests.services.tds.helpers import stub, tds_in_process


def sample(job: str, name: str, value: float, step: int, at_s: float, seq: int) -> Any:
    s = tds_pb2.MetricSample(
        job_id=job, learner=0, seq=seq, name=name, value=value, step=step, source="regex_extractor"
    )
    set_time_us(s, int(at_s * 1e6))
    return s


def test_add_metrics_leaves_each_jobs_newest_value_per_name_for_one_write_per_flush() -> None:
    writes: list[tuple[str, dict[str, Any]]] = []

    def write(job: str, rows: list[dict[str, Any]]) -> bool:
        writes.append((job, {r["name"]: r for r in rows}))
        return True

    last = LastMetrics(write)
    with tds_in_process(create_store("memory"), on_metrics=last.observe) as (address, _):
        channel, tds = stub(address)
        with channel:
            tds.AddMetrics(
                tds_pb2.AddMetricsRequest(
                    samples=[
                        sample("job-a", "loss", 0.9, 1, 100.0, 0),
                        sample("job-a", "loss", 0.5, 2, 101.0, 1),
                        sample("job-a", "acc", 0.7, 2, 101.0, 2),
                        sample("job-b", "loss", 2.0, 7, 100.0, 0),
                    ]
                )
            )
            # An older sample arriving late does not replace the newer value.
            tds.AddMetrics(
                tds_pb2.AddMetricsRequest(samples=[sample("job-a", "loss", 5.0, 0, 99.0, 3)])
            )
    assert last.flush() == 2
    by_job = dict(writes)
    assert by_job["job-a"]["loss"]["value"] == 0.5 and by_job["job-a"]["loss"]["step"] == 2
    assert by_job["job-a"]["acc"]["value"] == 0.7
    assert by_job["job-b"]["loss"]["step"] == 7
    # Nothing new since: the next flush writes nothing (a quiet job costs no write).
    assert last.flush() == 0


def test_a_failed_write_keeps_the_values_for_the_next_flush() -> None:
    calls: list[str] = []

    def write(job: str, rows: list[dict[str, Any]]) -> bool:
        calls.append(job)
        if len(calls) == 1:
            raise ConnectionError("jobs store down")
        return True

    last = LastMetrics(write)
    last.observe([sample("job-a", "loss", 0.5, 2, 101.0, 0)])
    assert last.flush() == 0
    assert last.flush() == 1
    assert calls == ["job-a", "job-a"]
