from __future__ import annotations

from collections.abc import Generator, Iterator

import grpc
import pymongo
import pytest
from rhizome.v1 import job_pb2, scheduler_pb2, scheduler_pb2_grpc

from services.embedded.process import ManagedServer
from services.scheduler.persist import MemoryPlacementStore, MongoPlacementStore
from services.scheduler.scheduler import GangScheduler
from services.scheduler.servicer import build_server
from services.store.placements import PlacementRepository
from tests.services.scheduler.conftest import gpu_cluster


def _serve(sched: GangScheduler) -> Generator[scheduler_pb2_grpc.SchedulerStub, None, None]:
    server, port = build_server(sched)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield scheduler_pb2_grpc.SchedulerStub(channel)
    finally:
        channel.close()
        server.stop(grace=None)


def _admit(
    stub: scheduler_pb2_grpc.SchedulerStub, job_id: str, learners: int, gpus: float
) -> scheduler_pb2.AdmitResponse:
    return stub.Admit(
        scheduler_pb2.AdmitRequest(
            job_id=job_id,
            owner="alice",
            resources=job_pb2.Resources(
                learners=learners, gpus=gpus, cpus=1, memory_mb=512, gpu_type="V100"
            ),
        )
    )


@pytest.fixture
def stub() -> Iterator[scheduler_pb2_grpc.SchedulerStub]:
    yield from _serve(GangScheduler(gpu_cluster(nodes=2, gpus=4), store=MemoryPlacementStore()))


def test_rpc_round_trip_admit_schedule_explain_release(
    stub: scheduler_pb2_grpc.SchedulerStub,
) -> None:
    assert _admit(stub, "a", 2, 2).admitted
    assert _admit(stub, "b", 2, 4).admitted
    placed = stub.Schedule(scheduler_pb2.ScheduleRequest()).placements
    assert [p.job_id for p in placed] == ["b"]  # submitted together: largest gang first
    assert len(placed[0].placement.learner_nodes) == 2
    assert "is queued" in stub.Explain(scheduler_pb2.ExplainRequest(job_id="a")).explanation
    view = stub.GetCluster(scheduler_pb2.GetClusterRequest())
    assert (view.queued_jobs, view.running_jobs) == (1, 1)
    assert sum(n.gpus_free for n in view.nodes) == 0
    assert stub.Release(scheduler_pb2.ReleaseRequest(job_id="b")).released
    assert [p.job_id for p in stub.Schedule(scheduler_pb2.ScheduleRequest()).placements] == ["a"]


def test_rpc_refusals_carry_the_reason(stub: scheduler_pb2_grpc.SchedulerStub) -> None:
    too_big = _admit(stub, "big", 3, 4)
    assert not too_big.admitted and "can never run" in too_big.reason
    fractional = _admit(stub, "half", 1, 0.5)
    assert not fractional.admitted and "fractional GPUs" in fractional.reason
    with pytest.raises(grpc.RpcError) as err:
        stub.Explain(scheduler_pb2.ExplainRequest(job_id="ghost"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.integration
def test_restarted_scheduler_reloads_reservations_from_mongodb(mongo_server: ManagedServer) -> None:
    client: pymongo.MongoClient[dict[str, object]] = pymongo.MongoClient(mongo_server.url)
    db = client.get_database("sched_restart_test")
    try:
        store = MongoPlacementStore(PlacementRepository(db))
        first = GangScheduler(gpu_cluster(nodes=2, gpus=4), store=store)
        server_iter = _serve(first)
        stub = next(server_iter)
        for job_id in ("j0", "j1", "j2"):
            assert _admit(stub, job_id, 2, 2).admitted
        before = {
            p.job_id: dict(p.placement.learner_nodes)
            for p in stub.Schedule(scheduler_pb2.ScheduleRequest()).placements
        }
        assert len(before) == 2
        server_iter.close()  # "crash": the process state is gone, MongoDB is not

        second = GangScheduler(
            gpu_cluster(nodes=2, gpus=4), store=MongoPlacementStore(PlacementRepository(db))
        )
        server_iter = _serve(second)
        stub = next(server_iter)
        # the reloaded reservations are delivered again; nothing new is double-booked
        again = {
            p.job_id: dict(p.placement.learner_nodes)
            for p in stub.Schedule(scheduler_pb2.ScheduleRequest()).placements
        }
        assert again == before
        assert stub.Schedule(scheduler_pb2.ScheduleRequest()).placements == []
        view = stub.GetCluster(scheduler_pb2.GetClusterRequest())
        assert (view.queued_jobs, view.running_jobs) == (1, 2)
        assert (
            all(n.gpus_free >= 0 for n in view.nodes) and sum(n.gpus_free for n in view.nodes) == 0
        )
        server_iter.close()
    finally:
        client.drop_database("sched_restart_test")
        client.close()
