"""Where a lost pipeline learner's replacement runs: the scheduler chooses (ReplaceLearner).

Real etcd and MongoDB-wire server, the real scheduler service (GangScheduler from a
two-node cluster config, behind its gRPC servicer on 127.0.0.1 with the internal port's
mutual TLS and service credential), a guardian process as the LCM starts it, the local
backend and the pipeline runtime's float64 toy. The planner's own cases (no room,
a refused credential, an unreachable scheduler) run against the same service without a
job, in a second each.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from contract.procs import free_port
from services.guardian.replacement import ReplacementPlanner, SchedulerAccess
from services.scheduler.requests import job_request
from services.scheduler.scheduler import GangScheduler
from services.scheduler.servicer import add_to_server, build_scheduler
from services.security.api import GUARDIAN_SERVICE_TOKEN_ENV, JOB_TLS_ENV
from services.security.internal import InternalAuthInterceptor, SharedSecretCredentials
from services.security.tls import InternalTls
from services.store import states
from tests.services.guardian.helpers import pipeline_job, submit

pytestmark = pytest.mark.integration

CLUSTER = """nodes:
  - name: node-a
    cpus: 4
    memory_mb: 4096
    zone: zone-a
  - name: node-b
    cpus: 4
    memory_mb: 4096
    zone: zone-b
"""


class SchedulerService:
    """The scheduler's internal port as the daemon serves it: mutual TLS, and every call
    authenticated by the service credential."""

    def __init__(self, tmp: Path) -> None:
        (tmp / "cluster.yaml").write_text(CLUSTER)
        self.scheduler: GangScheduler = build_scheduler(tmp / "cluster.yaml")
        self.tls = InternalTls.open(tmp / "tls")
        self.credentials = SharedSecretCredentials("rz_svc_" + "s" * 40)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4),
            interceptors=[InternalAuthInterceptor(self.credentials)],
        )
        self.servicer = add_to_server(self.server, self.scheduler)
        port = self.server.add_secure_port("127.0.0.1:0", self.tls.server_credentials())
        self.address = f"127.0.0.1:{port}"
        self.server.start()

    def place(self, repo: Any, job_id: str) -> dict[str, str]:
        """Queue and place the stored job as the daemon's scheduler loop does; PENDING."""
        with self.servicer._lock:
            self.scheduler.enqueue(job_request(repo.get(job_id)))
            self.scheduler.schedule()
            placement = self.scheduler.placement(job_id)
        assert placement is not None, self.scheduler.explain(job_id)
        nodes = {str(r): n for r, n in enumerate(placement.learner_nodes)}
        repo.transition(
            job_id, states.PENDING, "placed", placement={"learner_nodes": nodes, "placed_at": 0}
        )
        return nodes

    def nodes_of(self, job_id: str) -> list[str]:
        with self.servicer._lock:
            placement = self.scheduler.placement(job_id)
        assert placement is not None
        return list(placement.learner_nodes)

    def stop(self) -> None:
        self.server.stop(grace=None).wait()


@pytest.fixture
def service(tmp_path: Path) -> Iterator[SchedulerService]:
    svc = SchedulerService(tmp_path)
    try:
        yield svc
    finally:
        svc.stop()


def notes(repo: Any, job_id: str) -> list[str]:
    return [h.message for h in repo.get(job_id).history]


def test_the_replacement_runs_where_the_scheduler_put_it_and_falls_back_when_it_is_gone(
    stores: dict[str, Any], service: SchedulerService, tmp_path: Path
) -> None:
    """Learner 1 (stage 1, on node-b: the stages are zone-aware) dies at step 2 → the
    guardian asks the scheduler → the replacement starts on node-a, the only other node,
    which the job record, the scheduler and the learner's own environment
    (LOCAL_WORLD_SIZE 2: it shares node-a with learner 0) all say, and the history names
    it. The scheduler is then stopped; the replacement dies at step 40 → the guardian
    asks three times, then starts the next replacement on the node the lost one ran on,
    saying why; the job COMPLETES."""
    repo = stores["repo"]
    command = (
        'echo "local_world=$LOCAL_WORLD_SIZE" && exec python train.py --steps 80 '
        "--die 1:2 --die-replacement 1:40 --gate 30:2,60:4"
    )
    first: dict[str, str] = {}
    with pipeline_job(
        stores,
        tmp_path,
        command,
        place=lambda job: first.update(service.place(repo, job.job_id)),
        # as the LCM starts it: the address on the command line, the credential and the
        # job's client certificate in the environment
        guardian_args=[f"--scheduler={service.address}"],
        guardian_env=lambda job: {
            GUARDIAN_SERVICE_TOKEN_ENV: service.credentials.service_token(),
            JOB_TLS_ENV: json.dumps(service.tls.job_credentials(job.job_id)),
        },
    ) as run:
        assert first == {"0": "node-a", "1": "node-b"}, first  # a stage and its shadow apart
        chosen = (
            "learner 1's replacement runs on node node-a, chosen by the scheduler (a gang of "
            "one; learner 1 was lost on node node-b)"
        )
        run.wait("the scheduler's choice in the history", lambda: chosen in run.notes())
        placement = repo.get(run.job.job_id).placement
        assert placement["learner_nodes"] == {"0": "node-a", "1": "node-a"}
        assert service.nodes_of(run.job.job_id) == ["node-a", "node-a"]
        service.stop()  # the scheduler goes away before the second loss
        record = run.end()
    messages = [h.message for h in record.history]
    assert record.status == states.COMPLETED, run.explain()
    fallback = [m for m in messages if "replacement reuses node" in m]
    assert len(fallback) == 1, messages
    assert fallback[0].startswith(
        "learner 1's replacement reuses node node-a, where learner 1 was lost: the scheduler "
        f"at {service.address} answered UNAVAILABLE"
    ), fallback
    assert fallback[0].endswith("(asked 3 times)"), fallback
    expected = [
        "learner 1 preempted; stage 1 now served by learner 0 (generation 1)",
        chosen,
        "learner 1 lost: a replacement joins as a standby (replacement 1 of at most 2)",
        "learner 1 replaced: stage 1 served by its own learner again, every block has a "
        "replica (generation 2)",
        "learner 1 preempted; stage 1 now served by learner 0 (generation 3)",
        fallback[0],
        "learner 1 lost: a replacement joins as a standby (replacement 2 of at most 2)",
        "learner 1 replaced: stage 1 served by its own learner again, every block has a "
        "replica (generation 4)",
    ]
    assert [m for m in messages if m in expected] == expected, messages
    # each incarnation of learner 1 ran where the history says: alone on node-b, then
    # beside learner 0 on node-a (twice)
    out1 = (run.learners_dir / "1" / "stdout.log").read_text()
    worlds = [line for line in out1.splitlines() if line.startswith("local_world=")]
    assert worlds == ["local_world=1", "local_world=2", "local_world=2"], out1


def _planner(service: SchedulerService, token: str, **kwargs: Any) -> ReplacementPlanner:
    access = SchedulerAccess(service.address, token, service.tls.job_credentials("planner"))
    return ReplacementPlanner(access, **kwargs)


def test_no_room_elsewhere_is_asked_again_then_the_lost_node_is_reused_saying_why(
    stores: dict[str, Any], service: SchedulerService, tmp_path: Path
) -> None:
    repo = stores["repo"]
    # four learners of 2 cpus fill both nodes: no node but the lost one has room
    job = submit(repo, tmp_path, "true", learners=4, place=False, cpus=2)
    placement = {"learner_nodes": service.place(repo, job.job_id)}
    clock = [0.0]
    planner = _planner(
        service, service.credentials.service_token(), tries=2, retry_s=5.0, clock=lambda: clock[0]
    )
    try:
        assert planner.decide(job.job_id, 3, placement) is None  # asked once: no room
        assert planner.decide(job.job_id, 3, placement) is None  # not asked before retry_s
        clock[0] = 5.0
        got = planner.decide(job.job_id, 3, placement)
    finally:
        planner.close()
    assert got is not None and not got.chosen_by_scheduler
    lost_on = placement["learner_nodes"]["3"]
    assert got.node == lost_on and got.placement == placement
    assert got.note.startswith(
        f"learner 3's replacement reuses node {lost_on}, where learner 3 was lost: the "
        f"scheduler has no node for it now: job {job.job_id}: no node other than {lost_on}"
    ), got.note
    assert got.note.endswith("(asked 2 times)"), got.note
    assert service.nodes_of(job.job_id) == [placement["learner_nodes"][str(r)] for r in range(4)]


def test_a_refused_credential_falls_back_at_once_and_names_the_refusal(
    stores: dict[str, Any], service: SchedulerService, tmp_path: Path
) -> None:
    repo = stores["repo"]
    job = submit(repo, tmp_path, "true", learners=2, place=False)
    placement = {"learner_nodes": service.place(repo, job.job_id)}
    planner = _planner(service, "rz_svc_" + "w" * 40)  # a wrong service credential
    try:
        got = planner.decide(job.job_id, 1, placement)
    finally:
        planner.close()
    assert got is not None and not got.chosen_by_scheduler
    assert got.node == placement["learner_nodes"]["1"] and got.placement == placement
    assert "answered UNAUTHENTICATED: wrong service credential" in got.note, got.note
    assert "(asked" not in got.note  # not asked again: the answer would not change
    assert "w" * 40 not in got.note  # the credential itself is never written down


def test_an_unreachable_scheduler_is_asked_the_configured_times_then_the_lost_node(
    tmp_path: Path,
) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    clock = [0.0]
    planner = ReplacementPlanner(
        SchedulerAccess(address, "rz_svc_" + "s" * 40), tries=3, retry_s=1.0, clock=lambda: clock[0]
    )
    placement = {"learner_nodes": {"0": "node-a", "1": "node-b"}}
    try:
        for n in range(2):
            assert planner.decide("job", 1, placement) is None, n
            clock[0] += 1.0
        got = planner.decide("job", 1, placement)
    finally:
        planner.close()
    assert got is not None and got.node == "node-b" and not got.chosen_by_scheduler
    assert got.note.startswith(
        f"learner 1's replacement reuses node node-b, where learner 1 was lost: the scheduler "
        f"at {address} answered UNAVAILABLE"
    ), got.note
    assert got.note.endswith("(asked 3 times)"), got.note


def test_without_a_scheduler_the_lost_node_is_reused_silently() -> None:
    placement = {"learner_nodes": {"0": "local", "1": "local"}}
    got = ReplacementPlanner(None).decide("job", 1, placement)
    assert got is not None and got.node == "local" and got.note == ""
    assert got.placement == placement and not got.chosen_by_scheduler
