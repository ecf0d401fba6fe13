"""Our gang scheduler on Kubernetes, against the API emulator: the cluster model built
from watched Nodes (allocatable, zone, spot, cordons, taints, removals), whole gangs
placed by the BSA policy and bound through the Binding subresource all or none, and the
reason written on a gang's pods when it cannot fit."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from services.backends.kubernetes.api import GangBindError
from services.backends.kubernetes.scheduler import GangScheduler, node_from_object
from services.backends.kubernetes.spec import pod_name
from tests.kubernetes.conftest import Cluster, deploy, make_job, validate
from tests.kubernetes.emulator import Emulator

pytestmark = pytest.mark.kubernetes


def node(name: str, cpu: str = "8", memory: str = "32Gi", gpus: int = 0, **extra: Any) -> Any:
    labels = {"kubernetes.io/hostname": name, **extra.pop("labels", {})}
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": extra.pop("spec", {}),
        "status": {
            "allocatable": {
                "cpu": cpu,
                "memory": memory,
                "pods": "110",
                **({"nvidia.com/gpu": str(gpus)} if gpus else {}),
            },
            "conditions": [{"type": "Ready", "status": extra.pop("ready", "True")}],
        },
    }
    validate(obj)
    return obj


def wait_for(check: Callable[[], object], what: str, timeout: float = 10.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def scheduler(cluster: Cluster, emulator: Emulator) -> Any:
    """Needs the emulator: the tests make up their own Nodes."""
    sched = GangScheduler(cluster.settings).start()
    yield sched
    sched.close()


def test_node_model_reads_allocatable_zone_spot_and_gpu_type() -> None:
    n = node_from_object(
        node(
            "g1",
            cpu="7500m",
            memory="16Gi",
            gpus=4,
            labels={
                "topology.kubernetes.io/zone": "eu-1a",
                "karpenter.sh/capacity-type": "spot",
                "rhizome.io/gpu-type": "A100",
            },
        )
    )
    assert n is not None
    assert (n.cpus, n.memory_mb, n.gpus, n.gpu_type, n.zone) == (7.5, 16384.0, 4, "A100", "eu-1a")
    assert n.labels["rhizome.io/spot"] == "true"
    on_demand = node_from_object(node("c1", labels={"eks.amazonaws.com/capacityType": "ON_DEMAND"}))
    assert on_demand is not None and "rhizome.io/spot" not in on_demand.labels


def test_node_model_leaves_out_cordoned_tainted_and_not_ready_nodes() -> None:
    assert node_from_object(node("a", spec={"unschedulable": True})) is None
    assert node_from_object(node("b", ready="False")) is None
    tainted = {"taints": [{"key": "dedicated", "value": "x", "effect": "NoSchedule"}]}
    assert node_from_object(node("c", spec=tainted)) is None
    gpu_taint = {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}
    assert node_from_object(node("d", gpus=1, spec=gpu_taint)) is not None  # we tolerate it


def test_emulator_nodes_added_cordoned_and_removed_update_the_model(
    cluster: Cluster, scheduler: GangScheduler
) -> None:
    api = cluster.api()
    api.create_node(node("n1"))
    api.create_node(node("n2"))
    wait_for(lambda: [n.name for n in scheduler.node_watch.nodes()] == ["n1", "n2"], "2 nodes")
    api.patch_node("n1", {"spec": {"unschedulable": True}})
    wait_for(lambda: [n.name for n in scheduler.node_watch.nodes()] == ["n2"], "n1 cordoned")
    api.delete_node("n2")
    wait_for(lambda: scheduler.node_watch.nodes() == [], "n2 removed")


def test_emulator_gang_placed_and_bound_whole_by_our_scheduler(
    cluster: Cluster, emulator: Emulator, scheduler: GangScheduler, tmp_path: Path
) -> None:
    api = cluster.api()
    for i in range(3):
        api.create_node(node(f"n{i}", cpu="2", memory="4Gi"))
    wait_for(lambda: len(scheduler.node_watch.nodes()) == 3, "3 nodes")
    backend = cluster.backend()
    job = make_job(tmp_path, learners=3)  # 1.5 CPUs each: one learner per node
    deploy(backend, job)
    outcome = scheduler.schedule_once()
    assert sorted(outcome[job.job_id].split(",")) == ["n0", "n1", "n2"]
    pods = cluster.objects("pods", job.job_id)
    assert sorted(p["spec"]["nodeName"] for p in pods) == ["n0", "n1", "n2"]
    assert sorted(pod for pod, _ in emulator.km.bindings) == sorted(
        pod_name(job.job_id, r, 3, 0) for r in range(3)
    )


def test_emulator_gang_too_big_binds_nothing_and_says_why(
    cluster: Cluster, emulator: Emulator, scheduler: GangScheduler, tmp_path: Path
) -> None:
    api = cluster.api()
    api.create_node(node("n0", cpu="2", memory="4Gi"))
    api.create_node(node("n1", cpu="2", memory="4Gi"))
    wait_for(lambda: len(scheduler.node_watch.nodes()) == 2, "2 nodes")
    job = make_job(tmp_path, learners=3)  # 3 × 1.5 CPUs on 2 × 2 CPUs: never
    deploy(cluster.backend(), job)
    outcome = scheduler.schedule_once()
    assert "can never fit" in outcome[job.job_id]
    assert emulator.km.bindings == []
    for pod in cluster.objects("pods", job.job_id):
        assert "nodeName" not in pod["spec"]
        (cond,) = pod["status"]["conditions"]
        assert cond["reason"] == "Unschedulable" and "can never fit" in cond["message"]


def test_emulator_unknown_gpu_type_is_explained(
    cluster: Cluster, scheduler: GangScheduler, tmp_path: Path
) -> None:
    cluster.api().create_node(node("g0", gpus=8, labels={"rhizome.io/gpu-type": "V100"}))
    wait_for(lambda: len(scheduler.node_watch.nodes()) == 1, "1 node")
    job = make_job(tmp_path, "gpus: 1\ngpu_type: H100\n", learners=2, gpus_per_learner=1.0)
    deploy(cluster.backend(), job)
    outcome = scheduler.schedule_once()
    assert "no node has GPUs of type 'H100' (GPU types: V100)" in outcome[job.job_id]


def test_emulator_incomplete_gang_waits(
    cluster: Cluster, scheduler: GangScheduler, tmp_path: Path
) -> None:
    cluster.api().create_node(node("n0"))
    wait_for(lambda: len(scheduler.node_watch.nodes()) == 1, "1 node")
    backend = cluster.backend()
    job = make_job(tmp_path, learners=2)
    backend.prepare_volume(job)
    backend.write_secrets(job)
    backend.start_learner(job, 0, 0)  # rank 1 not created yet
    assert job.job_id not in scheduler.schedule_once()
    backend.start_learner(job, 1, 0)
    assert scheduler.schedule_once()[job.job_id] == "n0,n0"


def test_emulator_gang_bind_is_all_or_none(
    cluster: Cluster, scheduler: GangScheduler, tmp_path: Path
) -> None:
    api = cluster.api()
    api.create_node(node("n0"))
    job = make_job(tmp_path, learners=3)
    deploy(cluster.backend(), job)
    names = [pod_name(job.job_id, r, 3, 0) for r in range(3)]
    ns = cluster.settings.namespace
    # Someone else bound the last pod meanwhile: our binding of it is refused (409).
    scheduler.bind_gang(ns, {names[2]: "n0"})
    with pytest.raises(GangBindError, match="already bound were deleted"):
        scheduler.bind_gang(ns, {names[0]: "n0", names[1]: "n0", names[2]: "n0"})
    left = {p["metadata"]["name"] for p in cluster.objects("pods", job.job_id)}
    assert names[0] not in left and names[1] not in left  # none of this gang stays bound


def test_emulator_binder_honours_the_placement_the_scheduler_service_recorded(
    cluster: Cluster, scheduler: GangScheduler, tmp_path: Path
) -> None:
    api = cluster.api()
    for name in ("n0", "n1", "n2"):
        api.create_node(node(name, cpu="4", memory="8Gi"))
    wait_for(lambda: len(scheduler.node_watch.nodes()) == 3, "3 nodes")
    # pack alone would put both learners on one node; the recorded choice is n2 and n1
    recorded = make_job(tmp_path, learners=2, placement={"learner_nodes": {"0": "n2", "1": "n1"}})
    deploy(cluster.backend(), recorded)
    pods = cluster.objects("pods", recorded.job_id)
    assert {p["metadata"]["annotations"]["rhizome.io/scheduled-node"] for p in pods} == {"n1", "n2"}
    for pod in pods:
        validate(pod)
    assert scheduler.schedule_once()[recorded.job_id] == "n2,n1"
    by_rank = {
        p["metadata"]["labels"]["rhizome.io/rank"]: p["spec"]["nodeName"]
        for p in cluster.objects("pods", recorded.job_id)
    }
    assert by_rank == {"0": "n2", "1": "n1"}


def test_emulator_binder_places_anew_when_the_recorded_node_is_gone_or_full(
    cluster: Cluster, scheduler: GangScheduler, tmp_path: Path
) -> None:
    api = cluster.api()
    api.create_node(node("n0", cpu="4", memory="8Gi"))
    api.create_node(node("n1", cpu="2", memory="8Gi"))
    wait_for(lambda: len(scheduler.node_watch.nodes()) == 2, "2 nodes")
    gone = make_job(tmp_path, learners=1, placement={"learner_nodes": {"0": "removed-node"}})
    deploy(cluster.backend(), gone)
    assert scheduler.schedule_once()[gone.job_id] in ("n0", "n1")
    # n1 has 2 CPUs: two learners of 1.5 CPUs recorded there cannot both fit any more
    full = make_job(tmp_path, learners=2, placement={"learner_nodes": {"0": "n1", "1": "n1"}})
    deploy(cluster.backend(), full)
    placed = scheduler.schedule_once()[full.job_id].split(",")
    assert placed != ["n1", "n1"] and len(placed) == 2


def test_emulator_bound_pods_take_room_from_the_model(
    cluster: Cluster, scheduler: GangScheduler, tmp_path: Path
) -> None:
    api = cluster.api()
    api.create_node(node("n0", cpu="4", memory="8Gi"))
    api.create_node(node("n1", cpu="4", memory="8Gi"))
    wait_for(lambda: len(scheduler.node_watch.nodes()) == 2, "2 nodes")
    first = make_job(tmp_path, learners=2)
    deploy(cluster.backend(), first)
    placed = scheduler.schedule_once()[first.job_id].split(",")
    assert len(set(placed)) == 1  # pack: both on one node (3 of its 4 CPUs)
    second = make_job(tmp_path, learners=2)
    deploy(cluster.backend(), second)
    again = scheduler.schedule_once()[second.job_id].split(",")
    assert set(again).isdisjoint(placed)  # the first gang's node has 1 CPU left


def test_emulator_binder_loop_follows_pods_by_watch_and_relists_after_410(
    cluster: Cluster, emulator: Emulator, tmp_path: Path
) -> None:
    import threading

    api = cluster.api()
    api.create_node(node("n0", cpu="8", memory="16Gi"))
    sched = GangScheduler(cluster.settings)
    stop = threading.Event()
    loop = threading.Thread(target=sched.run, args=(stop, 0.05), daemon=True)
    loop.start()
    try:
        wait_for(sched.pod_watch.synced.is_set, "the pod watch's first list")
        first = make_job(tmp_path, learners=2)
        backend = cluster.backend()
        deploy(backend, first)
        wait_for(
            lambda: all(p["spec"].get("nodeName") for p in cluster.objects("pods", first.job_id)),
            "the first gang bound",
        )
        # Rounds read the watched view: no list per round, one list in all so far.
        assert sched.pod_watch.relists == 1 and sched.rounds >= 1
        # The API server restarts and the next watch is answered 410 Gone: listed again.
        # (The backend's own pod watch must not take the 410 meant for the binder's.)
        backend.close()
        emulator.km.gone_only = "pods"
        emulator.km.gone_next = 1
        emulator.restart()
        wait_for(lambda: sched.pod_watch.gone >= 1, "the 410 answered by a relist", 60)
        second = make_job(tmp_path, learners=2)
        deploy(cluster.backend(), second)
        wait_for(
            lambda: all(p["spec"].get("nodeName") for p in cluster.objects("pods", second.job_id)),
            "the second gang bound after the relist",
        )
        assert len(emulator.km.bindings) == 4  # each pod bound once, none twice
    finally:
        stop.set()
        loop.join(timeout=10)
        sched.close()


def test_emulator_node_source_follows_node_changes_not_heartbeats(
    cluster: Cluster, emulator: Emulator
) -> None:
    """The scheduler service's cluster source (services/scheduler/source.py) on
    Kubernetes: the same node model as the binder, a new version per real change."""
    from services.backends.kubernetes.cluster_source import KubernetesNodeSource

    api = cluster.api()
    api.create_node(node("n1", cpu="4", labels={"topology.kubernetes.io/zone": "z1"}))
    changes: list[int] = []
    source = KubernetesNodeSource(cluster.settings)
    source.start(lambda: changes.append(source.version()))
    try:
        assert [(n.name, n.cpus, n.zone) for n in source.nodes()] == [("n1", 4.0, "z1")]
        first = source.version()
        api.create_node(node("n2", labels={"karpenter.sh/capacity-type": "spot"}))
        wait_for(lambda: [n.name for n in source.nodes()] == ["n1", "n2"], "n2 added")
        assert source.nodes()[1].labels["rhizome.io/spot"] == "true"
        after_add = source.version()
        assert after_add > first
        # A kubelet heartbeat (a condition's time) changes nothing the model reads.
        api.patch_node_status(
            "n1",
            {
                "status": {
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "True",
                            "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                        }
                    ]
                }
            },
        )
        api.patch_node("n1", {"metadata": {"annotations": {"seen": "yes"}}})
        wait_for(
            lambda: any(
                (o["metadata"].get("annotations") or {}).get("seen")
                for o in cluster.objects("nodes")
            ),
            "the annotation stored",
        )
        api.patch_node("n2", {"spec": {"unschedulable": True}})
        wait_for(lambda: [n.name for n in source.nodes()] == ["n1"], "n2 cordoned")
        assert source.version() == after_add + 1  # the heartbeat and annotation: no change
        api.delete_node("n1")
        wait_for(lambda: source.nodes() == [], "n1 removed")
        assert changes and changes[-1] == source.version()
    finally:
        source.close()


def test_emulator_node_source_unreachable_server_says_what_to_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from contract.procs import free_port
    from services.backends.kubernetes import cluster_source
    from services.backends.kubernetes.api import KubeSettings
    from services.scheduler.api import ClusterConfigError

    monkeypatch.setattr(cluster_source, "FIRST_LIST_TIMEOUT_S", 1.0)
    settings = KubeSettings(server=f"http://127.0.0.1:{free_port()}", backoff_s=0.01)
    source = cluster_source.KubernetesNodeSource(settings)
    with pytest.raises(ClusterConfigError, match="could not list the cluster's Nodes"):
        source.start(lambda: None)


def test_scheduler_command_with_bad_input_prints_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.backends.kubernetes.scheduler import main

    monkeypatch.setenv("RHIZOME_K8S_PENDING_DEADLINE_S", "soon")
    assert main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "RHIZOME_K8S_PENDING_DEADLINE_S='soon'" in err
