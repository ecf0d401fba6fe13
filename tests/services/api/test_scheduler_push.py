"""The API hands every stored job to a scheduler in the same daemon through one thread of
its own (services/api/hosting.py: SchedulerPush), in submit order, and a push the
scheduler refuses or fails does not stop the ones after it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from rhizome.v1 import scheduler_pb2

from services.api.hosting import SchedulerPush
from services.local_channel import LocalChannel
from services.manifest import parse_manifest
from services.store.jobs import JobRecord

MANIFEST = "name: p\nlearners: 1\nframework:\n  command: python t.py\n"


class Scheduler:
    """`Admit` as the scheduler serves it, recording each request; a job id in `fail`
    raises, as a scheduler with a bug would."""

    def __init__(self) -> None:
        self.admitted: list[scheduler_pb2.AdmitRequest] = []
        self.threads: set[str] = set()
        self.fail: set[str] = set()
        self.lock = threading.Lock()

    def Admit(self, request: Any, context: Any) -> scheduler_pb2.AdmitResponse:
        if request.job_id in self.fail:
            raise RuntimeError(f"cannot admit {request.job_id} (test)")
        with self.lock:
            self.admitted.append(request)
            self.threads.add(threading.current_thread().name)
        return scheduler_pb2.AdmitResponse(admitted=True)


@pytest.fixture
def scheduler() -> Iterator[tuple[Scheduler, SchedulerPush]]:
    sched = Scheduler()
    handler = grpc.unary_unary_rpc_method_handler(
        sched.Admit,
        request_deserializer=scheduler_pb2.AdmitRequest.FromString,
        response_serializer=scheduler_pb2.AdmitResponse.SerializeToString,
    )
    fallback = grpc.insecure_channel("127.0.0.1:1")  # never called: Admit is local
    channel = LocalChannel({"/rhizome.v1.Scheduler/Admit": handler}, fallback)
    push = SchedulerPush(channel)  # type: ignore[arg-type]
    yield sched, push
    push.close()
    channel.close()


def job(job_id: str) -> JobRecord:
    return JobRecord.for_manifest(job_id, "alice", parse_manifest(MANIFEST))


def wait_for(cond: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "the pushes never arrived"
        time.sleep(0.005)


def test_every_stored_job_reaches_the_scheduler_in_order_from_one_thread(
    scheduler: tuple[Scheduler, SchedulerPush],
) -> None:
    sched, push = scheduler
    ids = [f"job-{i:03d}" for i in range(50)]
    for job_id in ids:
        push(job(job_id))
    wait_for(lambda: len(sched.admitted) == len(ids))
    assert [r.job_id for r in sched.admitted] == ids
    assert not any(r.check_only for r in sched.admitted)  # queued, not only checked
    assert sched.threads == {"scheduler-push"}


def test_a_failed_push_does_not_stop_the_ones_after_it(
    scheduler: tuple[Scheduler, SchedulerPush],
) -> None:
    sched, push = scheduler
    sched.fail.add("job-bad")
    for job_id in ("job-a", "job-bad", "job-b"):
        push(job(job_id))
    wait_for(lambda: len(sched.admitted) == 2)
    assert [r.job_id for r in sched.admitted] == ["job-a", "job-b"]
    # Pushes from many submitting threads at once all arrive, each once.

    def submitter(i: int) -> None:
        for n in range(20):
            push(job(f"t{i}-{n}"))

    threads = [threading.Thread(target=submitter, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_for(lambda: len(sched.admitted) == 2 + 8 * 20)
    assert len({r.job_id for r in sched.admitted}) == 2 + 8 * 20
