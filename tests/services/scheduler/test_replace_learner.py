"""A gang of one for a lost learner (`ReplaceLearner`), through the real scheduler
service (GangScheduler behind its gRPC server on 127.0.0.1)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from rhizome.v1 import job_pb2, scheduler_pb2, scheduler_pb2_grpc

from services.scheduler.persist import MemoryPlacementStore
from services.scheduler.scheduler import GangScheduler
from tests.services.scheduler.conftest import gpu_cluster
from tests.services.scheduler.test_servicer import _serve


@pytest.fixture
def stub() -> Iterator[scheduler_pb2_grpc.SchedulerStub]:
    yield from _serve(GangScheduler(gpu_cluster(nodes=3, gpus=4), store=MemoryPlacementStore()))


def _place(stub: scheduler_pb2_grpc.SchedulerStub, job_id: str, learners: int, gpus: int) -> None:
    admitted = stub.Admit(
        scheduler_pb2.AdmitRequest(
            job_id=job_id,
            owner="alice",
            resources=job_pb2.Resources(
                learners=learners, gpus=gpus, cpus=1, memory_mb=512, gpu_type="V100"
            ),
        )
    )
    assert admitted.admitted, admitted.reason
    placed = {p.job_id for p in stub.Schedule(scheduler_pb2.ScheduleRequest()).placements}
    assert job_id in placed


def _free(stub: scheduler_pb2_grpc.SchedulerStub) -> dict[str, int]:
    view = stub.GetCluster(scheduler_pb2.GetClusterRequest())
    return {n.name: n.gpus_free for n in view.nodes}


def test_a_lost_learner_is_replaced_on_another_node_or_waits_naming_why(
    stub: scheduler_pb2_grpc.SchedulerStub,
) -> None:
    _place(stub, "pipe", learners=2, gpus=4)  # one learner per node: two of three nodes
    before = stub.Explain(scheduler_pb2.ExplainRequest(job_id="pipe")).explanation
    assert before
    free = _free(stub)
    spare = [n for n, g in free.items() if g == 4]
    assert len(spare) == 1
    got = stub.ReplaceLearner(scheduler_pb2.ReplaceLearnerRequest(job_id="pipe", rank=1))
    assert got.placed and got.node == spare[0], got
    assert got.placement.learner_nodes[1] == spare[0]
    # the lost learner's node was given back, the new one is held: still 8 GPUs in use
    after = _free(stub)
    assert after[spare[0]] == 0 and sum(after.values()) == sum(free.values())
    # another job takes the freed node: the next loss finds no other node with room
    _place(stub, "other", learners=1, gpus=4)
    held = _free(stub)
    waiting = stub.ReplaceLearner(scheduler_pb2.ReplaceLearnerRequest(job_id="pipe", rank=0))
    assert not waiting.placed
    assert "no node other than" in waiting.reason and "waits" in waiting.reason, waiting
    assert _free(stub) == held  # nothing changed while it waits
    # room again (the other job ended): the same request is placed
    assert stub.Release(scheduler_pb2.ReleaseRequest(job_id="other")).released
    again = stub.ReplaceLearner(scheduler_pb2.ReplaceLearnerRequest(job_id="pipe", rank=0))
    assert again.placed and again.node != got.node, again


def test_replace_learner_refuses_unknown_jobs_and_ranks(
    stub: scheduler_pb2_grpc.SchedulerStub,
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.ReplaceLearner(scheduler_pb2.ReplaceLearnerRequest(job_id="nope", rank=0))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    _place(stub, "pipe", learners=2, gpus=1)
    with pytest.raises(grpc.RpcError) as info:
        stub.ReplaceLearner(scheduler_pb2.ReplaceLearnerRequest(job_id="pipe", rank=2))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no learner 2" in str(info.value.details())
