"""A scheduling pass after only new jobs arrived carries on from the last one over the
new jobs alone (GangScheduler._resume), and decides exactly what a pass over the whole
queue decides; a job the API's admission check accepted is not checked again when it is
queued (issue #18: both were the scheduler's cost of each submit)."""

from __future__ import annotations

from typing import Any, cast

from hypothesis import example, given, settings
from hypothesis import strategies as st

from services.scheduler.api import JobRequest, JobTooLarge
from services.scheduler.cluster import Cluster, Node
from services.scheduler.quota import quota_config_from_mapping
from services.scheduler.scheduler import GangScheduler
from tests.services.scheduler.conftest import gpu_cluster

QUOTAS = {
    "users": {
        "alice": {"quota": {"V100": 8}},
        "bob": {"quota": {"V100": 4}, "limit": {"V100": 8}},
    }
}


def _cluster() -> Cluster:
    """Two pools sharing CPUs: V100 nodes and CPU-only nodes."""
    return Cluster(
        [
            *gpu_cluster(nodes=3, gpus=4, zones=2).nodes,
            Node("c0", cpus=8, memory_mb=16384),
            Node("c1", cpus=8, memory_mb=16384),
        ]
    )


jobs = st.tuples(
    st.integers(1, 3),  # learners
    st.sampled_from([0, 1, 2, 4]),  # GPUs per learner (0: the cpu pool)
    st.integers(0, 2),  # priority
    st.sampled_from(["alice", "bob"]),
    st.sampled_from([0.0, 0.5, 2.0]),  # seconds after the job before (a batch: within 1 s)
)
submit = st.tuples(st.just("submit"), jobs)
schedule = st.tuples(st.just("schedule"), st.none())
ops = st.lists(
    st.one_of(submit, submit, schedule, st.tuples(st.just("release"), st.integers(0, 40))),
    max_size=60,
)


class Counting(dict[str, Any]):
    """The scheduler's records, counting the lookups a pass makes: one per queued job it
    looks at."""

    looked_up = 0

    def __getitem__(self, key: str) -> Any:
        self.looked_up += 1
        return super().__getitem__(key)


def _run(ops_list: list[tuple[str, object]], quotas: bool, incremental: bool) -> list[object]:
    clock = [0.0]
    sched = GangScheduler(
        _cluster(),
        quotas=quota_config_from_mapping(QUOTAS, ["V100"]) if quotas else None,
        clock=lambda: clock[0],
        incremental=incremental,
    )
    # every pass that may carry on from the last one does, however much time passed
    sched.full_pass_interval_s = float("inf")
    trace: list[object] = []
    n = 0
    for op, arg in ops_list:
        if op == "submit":
            learners, gpus, priority, owner, gap = cast(tuple[int, int, int, str, float], arg)
            clock[0] += gap
            job = JobRequest(
                f"j{n}",
                learners=learners,
                gpus=gpus,
                gpu_type="V100" if gpus else "",
                cpus=1.0,
                memory_mb=1024,
                owner=owner,
                priority=priority,
                arrival=clock[0],
            )
            trace.append(sched.submit(job))
            n += 1
        elif op == "schedule":
            trace.append(sched.schedule())
        else:
            trace.append(sched.release(f"j{arg}"))
        # what a pass leaves behind for the jobs it did not place, as `rhizome show` says
        trace.append(sched.queued())
        trace.append({j: (sched.explain(j), sched.records[j].blocked_by) for j in sched.queued()})
    return trace


@settings(max_examples=300, deadline=None)
@given(ops_list=ops, quotas=st.booleans())
# a job of a higher priority than those waiting sorts ahead of them: it is not taken
# on its own, as if it came last, but the whole queue is walked
@example(
    ops_list=[
        ("submit", (2, 4, 0, "alice", 0.0)),
        ("submit", (2, 4, 0, "alice", 0.0)),
        ("schedule", None),
        ("submit", (1, 1, 2, "alice", 0.0)),
        ("schedule", None),
    ],
    quotas=False,
)
# with quotas, a job placed changes how its owner's waiting jobs are counted (bob's
# borrower j1 goes over his limit and no longer holds alice's borrower j2 back): the
# pass after a placement walks the whole queue
@example(
    ops_list=[
        ("submit", (2, 4, 0, "alice", 0.0)),
        ("submit", (3, 2, 0, "bob", 0.0)),
        ("submit", (1, 1, 0, "alice", 0.0)),
        ("schedule", None),
        ("schedule", None),
        ("submit", (1, 4, 0, "bob", 2.0)),
        ("schedule", None),
        ("schedule", None),
    ],
    quotas=True,
)
def test_a_pass_over_the_new_jobs_decides_what_a_pass_over_the_whole_queue_does(
    ops_list: list[tuple[str, object]], quotas: bool
) -> None:
    assert _run(ops_list, quotas, incremental=True) == _run(ops_list, quotas, incremental=False)


def test_a_pass_after_new_jobs_behind_a_full_pool_looks_at_the_new_jobs_only() -> None:
    sched = GangScheduler(gpu_cluster(nodes=1, gpus=4), clock=lambda: 0.0)
    sched.submit(JobRequest("fill", learners=1, gpus=4, gpu_type="V100"))
    for i in range(200):
        sched.submit(JobRequest(f"w{i:03d}", learners=1, gpus=1, gpu_type="V100", arrival=1.0))
    assert [p.job_id for p in sched.schedule().placements] == ["fill"]
    records = sched.records = Counting(sched.records)
    for i in range(3):
        sched.submit(JobRequest(f"new{i}", learners=1, gpus=1, gpu_type="V100", arrival=2.0))
    assert sched.schedule().placements == []
    assert records.looked_up == 3  # not the 200 waiting before them
    assert records["new2"].blocked_by == "w000"  # as a pass over the whole queue says
    # a job freed: the next pass walks the whole queue, and the head takes the room
    sched.release("fill")
    records.looked_up = 0
    assert [p.job_id for p in sched.schedule().placements] == [f"w00{i}" for i in range(4)]
    assert records.looked_up >= 203


class CountingChecks(GangScheduler):
    checks = 0

    def check(self, job: JobRequest) -> None:
        self.checks += 1
        super().check(job)


def test_a_job_admitted_is_not_checked_again_when_it_is_queued() -> None:
    sched = CountingChecks(gpu_cluster(nodes=2, gpus=4))
    job = JobRequest("j", learners=2, gpus=4, gpu_type="V100", arrival=1.0)
    assert sched.admit(job).admitted
    sched.enqueue(JobRequest("j", learners=2, gpus=4, gpu_type="V100", arrival=2.0))
    assert sched.checks == 1
    assert sched.queued() == ["j"]


def test_a_queued_request_unlike_the_admitted_one_or_on_other_nodes_is_checked_again() -> None:
    sched = CountingChecks(gpu_cluster(nodes=2, gpus=4))
    assert sched.admit(JobRequest("grown", learners=1, gpus=4, gpu_type="V100")).admitted
    try:
        sched.enqueue(JobRequest("grown", learners=3, gpus=4, gpu_type="V100"))
        raise AssertionError("a job too large for the cluster was queued")
    except JobTooLarge:
        pass
    assert sched.admit(JobRequest("moved", learners=2, gpus=4, gpu_type="V100")).admitted
    sched.replace_nodes(gpu_cluster(nodes=1, gpus=4).nodes)  # one node left
    try:
        sched.enqueue(JobRequest("moved", learners=2, gpus=4, gpu_type="V100"))
        raise AssertionError("a job that can never run on the nodes left was queued")
    except JobTooLarge:
        pass
    assert sched.checks == 4
    assert sched.queued() == []
