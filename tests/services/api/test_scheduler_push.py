"""How the API hands each submit to the scheduler (services/api/hosting.py
`scheduler_ports`): a scheduler in the same daemon is called directly, without an `Admit`
proto (`HostedScheduler` over the scheduler's `LocalScheduler`, tests/services/scheduler/
test_local_scheduler.py), one elsewhere by `Admit` calls; each stored job is pushed
without making its submit wait, and a push that cannot be made does not stop the ones
after it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from rhizome.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.api import errors
from services.api.hosting import HostedScheduler, scheduler_ports, scheduler_push
from services.config import PlatformConfig
from services.hosting import DaemonContext
from services.manifest import parse_manifest
from services.store.jobs import JobRecord

MANIFEST = "name: p\nlearners: 1\nframework:\n  command: python t.py\n"


def job(job_id: str, gpus: float = 0) -> JobRecord:
    record = JobRecord.for_manifest(job_id, "alice", parse_manifest(MANIFEST))
    record.resources["gpus"] = gpus
    return record


class Scheduler(scheduler_pb2_grpc.SchedulerServicer):
    """`Admit` as a scheduler in another daemon serves it, recording each request."""

    def __init__(self) -> None:
        self.admitted: list[scheduler_pb2.AdmitRequest] = []
        self.lock = threading.Lock()

    def Admit(self, request: Any, context: Any) -> scheduler_pb2.AdmitResponse:
        with self.lock:
            self.admitted.append(request)
        return scheduler_pb2.AdmitResponse(admitted=True)


@pytest.fixture
def remote() -> Iterator[tuple[Scheduler, grpc.Channel]]:
    sched = Scheduler()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(sched, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield sched, channel
    channel.close()
    server.stop(None)


def wait_for(cond: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "the pushes never arrived"
        time.sleep(0.005)


def test_a_scheduler_elsewhere_gets_each_stored_job_queued_and_a_bad_one_is_skipped(
    remote: tuple[Scheduler, grpc.Channel],
) -> None:
    sched, channel = remote
    push = scheduler_push(channel)
    push(job("job-a"))
    push(job("job-half", gpus=0.5))  # no scheduler takes fractional GPUs: not pushed
    push(job("job-b"))
    wait_for(lambda: len(sched.admitted) == 2)
    assert sorted(r.job_id for r in sched.admitted) == ["job-a", "job-b"]
    assert not any(r.check_only for r in sched.admitted)  # queued, not only checked


class Local:
    """What the scheduler's build leaves in `ctx.shared["scheduler"]` (LocalScheduler)."""

    def __init__(self) -> None:
        self.checked: list[str] = []
        self.queued: list[str] = []

    def admit(self, job: JobRecord) -> tuple[bool, str]:
        self.checked.append(job.job_id)
        return (True, "") if job.job_id != "job-huge" else (False, "too large")

    def queue(self, job: JobRecord) -> None:
        self.queued.append(job.job_id)


def test_a_scheduler_in_this_daemon_is_called_directly_once_it_is_built() -> None:
    ctx = DaemonContext(PlatformConfig(services=("api", "scheduler")), server=None)  # type: ignore[arg-type]
    admit, on_stored = scheduler_ports(ctx)
    assert admit is not None and on_stored is not None
    assert ctx.channels == {}  # no channel to the scheduler was opened
    # built after the API: until then a submit cannot be checked, and a stored job is
    # left to the scheduler's first resync
    with pytest.raises(errors.Unavailable, match="not started yet"):
        admit(job("job-early"))
    on_stored(job("job-early"))
    local = ctx.shared["scheduler"] = Local()
    assert admit(job("job-a")) == (True, "")
    assert admit(job("job-huge")) == (False, "too large")
    on_stored(job("job-a"))
    assert (local.checked, local.queued) == (["job-a", "job-huge"], ["job-a"])


def test_without_a_scheduler_a_submit_is_neither_checked_nor_pushed() -> None:
    ctx = DaemonContext(PlatformConfig(services=("api",)), server=None)  # type: ignore[arg-type]
    assert scheduler_ports(ctx) == (None, None)


def test_hosted_scheduler_looks_the_scheduler_up_once() -> None:
    shared: dict[str, Any] = {}
    hosted = HostedScheduler(shared)
    local = shared["scheduler"] = Local()
    hosted.queue(job("job-a"))
    shared["scheduler"] = Local()  # not looked up again
    hosted.queue(job("job-b"))
    assert local.queued == ["job-a", "job-b"]
