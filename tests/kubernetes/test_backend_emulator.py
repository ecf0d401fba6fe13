"""The kubernetes backend with the real `kubernetes` client against the Kubernetes API
emulator (kmock; see tests/kubernetes/emulator.py for what it emulates and what the tests
add): the objects a deploy creates (each validated by kubernetes-validate against
Kubernetes 1.37 in strict mode), status changes followed through the watch, a 410 and an
API server restart survived, retries on 429/500 without duplicates, stuck pods failed
with their reason, and rollback complete and idempotent."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from contract.learner_spec import LearnerSpec
from services.backends.api import backend_names, get_backend
from services.backends.kubernetes.api import ApiUnreachable, KubeSettings, ObjectClash
from services.backends.kubernetes.backend import KubernetesBackend
from services.backends.kubernetes.spec import (
    LABEL_JOB,
    POD_SPEC_DIR,
    owner_name,
    pod_name,
    secrets_name,
)
from tests.kubernetes.conftest import (
    Cluster,
    deploy,
    make_job,
    set_pod_status,
    validate,
)
from tests.kubernetes.emulator import Emulator

pytestmark = pytest.mark.kubernetes


def wait_for(check: Callable[[], object], what: str, timeout: float = 10.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_backend_is_registered_as_kubernetes() -> None:
    assert "kubernetes" in backend_names()


def test_emulator_deploy_creates_valid_owned_labelled_objects(
    cluster: Cluster, tmp_path: Path
) -> None:
    backend = cluster.backend()
    job = make_job(
        tmp_path,
        "data_stores:\n  - id: s3\n    type: s3_datastore\n    connection:\n"
        "      access_key: AK\n      secret_key: SK\n",
    )
    deploy(backend, job)

    pods = cluster.objects("pods", job.job_id)
    secrets = cluster.objects("secrets", job.job_id)
    maps = cluster.objects("configmaps", job.job_id)
    policies = cluster.objects("networkpolicies", job.job_id)
    assert sorted(p["metadata"]["name"] for p in pods) == [
        pod_name(job.job_id, r, 3, 0) for r in range(2)
    ]
    assert len(maps) == 1 and maps[0]["metadata"]["name"] == owner_name(job.job_id)
    assert len(policies) == 1
    assert len(secrets) == 3  # the job's credentials + one learner spec per rank
    owner_uid = maps[0]["metadata"]["uid"]
    for obj in [*pods, *secrets, *policies, *maps]:
        validate(obj)
        assert obj["metadata"]["labels"][LABEL_JOB] == job.job_id
    for obj in [*pods, *secrets, *policies]:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref["kind"] == "ConfigMap" and ref["uid"] == owner_uid


def test_emulator_pod_spec_is_unprivileged_limited_and_ours(
    cluster: Cluster, tmp_path: Path
) -> None:
    backend = cluster.backend(image="registry.example/rhizome-learner:1")
    job = make_job(tmp_path, "gpus: 2\ngpu_type: A100\n", gpus_per_learner=2.0)
    deploy(backend, job)
    pod = next(
        p
        for p in cluster.objects("pods", job.job_id)
        if p["metadata"]["labels"]["rhizome.io/rank"] == "1"
    )
    labels = pod["metadata"]["labels"]
    assert (labels["rhizome.io/rank"], labels["rhizome.io/generation"]) == ("1", "3")
    spec = pod["spec"]
    assert spec["schedulerName"] == "rhizome"
    assert spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False
    assert spec["terminationGracePeriodSeconds"] == 8  # the job's grace, rounded up
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == 10001
    (container,) = spec["containers"]
    assert container["image"] == "registry.example/rhizome-learner:1"
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["limits"] == {
        "cpu": "1500m",
        "memory": "512Mi",
        "nvidia.com/gpu": "2",
    }
    assert container["resources"]["requests"] == container["resources"]["limits"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["spec"]["readOnly"] is True and mounts["secrets"]["readOnly"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["secrets"]["secret"] == {
        "secretName": secrets_name(job.job_id),
        "defaultMode": 0o400,
    }
    assert volumes["spec"]["secret"]["defaultMode"] == 0o400
    assert not any("hostPath" in v for v in spec["volumes"])  # code comes from the store
    assert container["command"][-1] == f"{POD_SPEC_DIR}/spec.json"


def test_emulator_learner_spec_secret_carries_the_spec_with_pod_paths(
    cluster: Cluster, tmp_path: Path
) -> None:
    backend = cluster.backend()
    job = make_job(tmp_path, learners=1)
    deploy(backend, job)
    secret = next(
        s for s in cluster.objects("secrets", job.job_id) if "spec.json" in s.get("data", {})
    )
    spec = LearnerSpec.from_json(base64.b64decode(secret["data"]["spec.json"]))
    assert (spec.job_id, spec.rank, spec.generation) == (job.job_id, 0, 3)
    assert spec.model_zip == job.model_zip  # the controller fetches it from the store
    assert spec.job_dir == "/var/lib/rhizome/job"
    assert spec.env["RHIZOME_SECRETS"].startswith("/var/lib/rhizome/job/secrets")
    assert str(tmp_path) not in json.dumps(spec.env)  # no host path leaks into the pod


def test_emulator_secrets_never_in_pod_spec_and_base64_in_secret(
    cluster: Cluster, tmp_path: Path
) -> None:
    backend = cluster.backend()
    job = make_job(
        tmp_path,
        "data_stores:\n  - id: s3\n    type: s3_datastore\n    connection:\n"
        "      secret_key: TOPSECRET\n",
        learners=1,
    )
    deploy(backend, job)
    (pod,) = cluster.objects("pods", job.job_id)
    assert "TOPSECRET" not in json.dumps(pod)
    creds = next(
        s
        for s in cluster.objects("secrets", job.job_id)
        if s["metadata"]["name"] == secrets_name(job.job_id)
    )
    assert base64.b64decode(creds["data"]["env"]).decode() == "S3_SECRET_KEY=TOPSECRET\n"


def test_emulator_network_policy_admits_the_job_and_the_platform_only(
    cluster: Cluster, tmp_path: Path
) -> None:
    backend = cluster.backend()
    job = make_job(tmp_path)
    deploy(backend, job)
    (policy,) = cluster.objects("networkpolicies", job.job_id)
    spec = policy["spec"]
    mine = {"matchLabels": {LABEL_JOB: job.job_id}}
    assert spec["podSelector"] == mine
    assert sorted(spec["policyTypes"]) == ["Egress", "Ingress"]
    assert spec["ingress"] == [{"from": [{"podSelector": mine}]}]
    targets = [peer for rule in spec["egress"] for peer in rule["to"]]
    assert {"podSelector": mine} in targets
    assert {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "rhizome"}},
    } in targets


def test_emulator_status_changes_followed_through_watch(cluster: Cluster, tmp_path: Path) -> None:
    backend = cluster.backend()
    job = make_job(tmp_path)
    handles = deploy(backend, job)
    api = cluster.api()
    ns = cluster.settings.namespace
    names = [pod_name(job.job_id, r, 3, 0) for r in range(2)]
    assert backend.learner_exited(handles[0]) is None
    set_pod_status(api, ns, names[0], "Running")
    wait_for(lambda: backend.controller_alive(job.job_id, 0, {}), "rank 0 alive")
    set_pod_status(api, ns, names[0], "Succeeded", exit_code=0, reason="Completed")
    set_pod_status(api, ns, names[1], "Failed", exit_code=143)
    assert wait_for(lambda: backend.learner_exited(handles[0]) == 0, "rank 0 succeeded")
    assert wait_for(lambda: backend.learner_exited(handles[1]) == 143, "rank 1 exit code")
    assert not backend.controller_alive(job.job_id, 1, {})


def test_emulator_oom_kill_and_node_loss_become_exit_notes(
    cluster: Cluster, tmp_path: Path
) -> None:
    backend = cluster.backend()
    job = make_job(tmp_path)
    handles = deploy(backend, job)
    api = cluster.api()
    ns = cluster.settings.namespace
    set_pod_status(
        api, ns, pod_name(job.job_id, 0, 3, 0), "Failed", exit_code=137, reason="OOMKilled"
    )
    set_pod_status(api, ns, pod_name(job.job_id, 1, 3, 0), "Failed", pod_reason="NodeLost")
    assert wait_for(lambda: backend.learner_exited(handles[0]) == 137, "OOM exit")
    assert wait_for(lambda: backend.learner_exited(handles[1]) is not None, "node loss exit")
    assert backend.exit_note(job.job_id, 0) == (
        "out of memory: the learner's pod hit its memory limit of 512Mi (OOM kill)"
    )
    assert "was lost (NodeLost)" in backend.exit_note(job.job_id, 1)


def test_emulator_pod_deleted_under_us_reads_as_killed(cluster: Cluster, tmp_path: Path) -> None:
    backend = cluster.backend()
    job = make_job(tmp_path, learners=1)
    handles = deploy(backend, job)
    cluster.api().delete_namespaced_pod(pod_name(job.job_id, 0, 3, 0), cluster.settings.namespace)
    assert wait_for(lambda: backend.learner_exited(handles[0]) == 137, "deleted pod exit")


def test_emulator_watch_survives_410_gone_by_relisting(
    cluster: Cluster, emulator: Emulator, tmp_path: Path
) -> None:
    backend = cluster.backend()
    job = make_job(tmp_path, learners=1)
    emulator.km.gone_next = 1
    handles = deploy(backend, job)
    watch = backend.watch(job.job_id)
    wait_for(lambda: watch.gone >= 1, "the 410 to be seen")
    set_pod_status(
        cluster.api(),
        cluster.settings.namespace,
        pod_name(job.job_id, 0, 3, 0),
        "Failed",
        exit_code=3,
    )
    assert wait_for(lambda: backend.learner_exited(handles[0]) == 3, "exit after the 410")
    assert watch.relists >= 2


def test_emulator_watch_survives_api_server_restart(
    cluster: Cluster, emulator: Emulator, tmp_path: Path
) -> None:
    backend = cluster.backend()
    job = make_job(tmp_path, learners=1)
    handles = deploy(backend, job)
    watch = backend.watch(job.job_id)
    wait_for(watch.synced.is_set, "first sync")
    watches = lambda: sum(1 for r in emulator.km._requests if "watch=true" in str(r.url))  # noqa: E731
    before = watches()
    emulator.halt()
    # While it is down, the pod ends (its status is stored; the server will tell on return).
    name = pod_name(job.job_id, 0, 3, 0)
    for (res, _ns, obj_name), obj in list(emulator.km.objects.items()):
        if res.plural == "pods" and obj_name == name:
            obj.patch(
                {
                    "status": {
                        "phase": "Failed",
                        "containerStatuses": [
                            {"name": "learner", "state": {"terminated": {"exitCode": 143}}}
                        ],
                    }
                }
            )
    emulator.serve()
    assert wait_for(lambda: backend.learner_exited(handles[0]) == 143, "exit after restart", 20)
    assert watches() > before  # the stream was opened again on the restarted server


def test_emulator_reconciles_after_backend_restart(cluster: Cluster, tmp_path: Path) -> None:
    """A new guardian (a new backend) finds the running pods of the job from the server."""
    first = cluster.backend()
    job = make_job(tmp_path)
    deploy(first, job)
    first.close()
    set_pod_status(
        cluster.api(), cluster.settings.namespace, pod_name(job.job_id, 0, 3, 0), "Running"
    )
    second = cluster.backend()
    assert len(second.running(job.job_id)) == 2
    assert wait_for(lambda: second.controller_alive(job.job_id, 0, {}), "adopted rank 0")
    # Starting the same learner again adopts the live pod instead of duplicating it.
    second.start_learner(job, 0, 0)
    assert len(cluster.objects("pods", job.job_id)) == 2


def test_emulator_retries_429_and_500_without_duplicates(
    cluster: Cluster, emulator: Emulator, tmp_path: Path
) -> None:
    backend = cluster.backend()
    job = make_job(tmp_path)
    emulator.km.fail_next = [429, 500, 503, 500]
    deploy(backend, job)
    assert backend.calls.retries >= 4
    assert len(cluster.objects("pods", job.job_id)) == 2
    assert len(cluster.objects("configmaps", job.job_id)) == 1


def test_emulator_create_answered_409_adopts_our_object_only(
    cluster: Cluster, tmp_path: Path
) -> None:
    backend = cluster.backend()
    job = make_job(tmp_path, learners=1)
    deploy(backend, job)
    # The same deploy again (a guardian whose answers were lost) changes nothing.
    deploy(cluster.backend(), job)
    assert len(cluster.objects("pods", job.job_id)) == 1
    # A pod of the name that is not the job's is a clash, named in the error.
    other = make_job(tmp_path, learners=1, job_id="job-other")
    api = cluster.api()
    foreign: Any = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name("job-other", 0, 3, 0),
            "namespace": cluster.settings.namespace,
            "labels": {LABEL_JOB: "someone"},
        },
        "spec": {"containers": [{"name": "c", "image": "x"}]},
    }
    api.create_namespaced_pod(cluster.settings.namespace, foreign)
    fresh = cluster.backend()
    fresh.prepare_volume(other)
    fresh.write_secrets(other)
    with pytest.raises(ObjectClash, match="is not this job's"):
        fresh.start_learner(other, 0, 0)


def test_emulator_unreachable_server_is_a_clear_error(tmp_path: Path) -> None:
    from contract.procs import free_port

    settings = KubeSettings(server=f"http://127.0.0.1:{free_port()}", attempts=2, backoff_s=0.01)
    backend = KubernetesBackend(settings)
    with pytest.raises(ApiUnreachable, match=r"failed 2 times.*RHIZOME_K8S_SERVER"):
        backend.prepare_volume(make_job(tmp_path))
    backend.close()


def test_emulator_pending_past_deadline_fails_with_reason_and_leaves_nothing(
    cluster: Cluster, tmp_path: Path
) -> None:
    backend = cluster.backend(pending_deadline_s=0.3)
    job = make_job(tmp_path)
    handles = deploy(backend, job)
    api = cluster.api()
    ns = cluster.settings.namespace
    set_pod_status(api, ns, pod_name(job.job_id, 0, 3, 0), "Pending", waiting="ImagePullBackOff")
    set_pod_status(api, ns, pod_name(job.job_id, 1, 3, 0), "Running")
    assert wait_for(lambda: backend.learner_exited(handles[0]) == 1, "the deadline", 10)
    assert "stayed Pending (ImagePullBackOff" in backend.exit_note(job.job_id, 0)
    assert backend.learner_exited(handles[1]) is None  # a running pod has no deadline
    backend.rollback(job.job_id, job.job_dir)
    for plural in ("pods", "secrets", "configmaps", "networkpolicies"):
        assert cluster.objects(plural, job.job_id) == []


def test_emulator_invalid_image_fails_at_once(cluster: Cluster, tmp_path: Path) -> None:
    backend = cluster.backend()  # the default deadline: 300 s
    job = make_job(tmp_path, learners=1)
    handles = deploy(backend, job)
    set_pod_status(
        cluster.api(),
        cluster.settings.namespace,
        pod_name(job.job_id, 0, 3, 0),
        "Pending",
        waiting="InvalidImageName",
    )
    assert wait_for(lambda: backend.learner_exited(handles[0]) == 1, "the hopeless reason")
    assert "cannot start (InvalidImageName" in backend.exit_note(job.job_id, 0)


def test_emulator_rollback_removes_everything_of_the_job_only_and_is_idempotent(
    cluster: Cluster, tmp_path: Path
) -> None:
    backend = cluster.backend()
    job, other = make_job(tmp_path), make_job(tmp_path)
    deploy(backend, job)
    deploy(backend, other)
    backend.rollback(job.job_id, job.job_dir)
    backend.rollback(job.job_id, job.job_dir)  # again: nothing left, no error
    for plural in ("pods", "secrets", "configmaps", "networkpolicies"):
        assert cluster.objects(plural, job.job_id) == [], plural
    assert len(cluster.objects("pods", other.job_id)) == 2
    assert backend.running(job.job_id) == []


def test_emulator_rollback_mid_deploy_leaves_nothing(cluster: Cluster, tmp_path: Path) -> None:
    """The daemon killed between steps: the next guardian's rollback finds it all by label."""
    job = make_job(tmp_path)
    first = cluster.backend()
    first.prepare_volume(job)
    first.write_secrets(job)
    first.start_learner(job, 0, 0)  # ... and the process dies here
    first.close()
    cluster.backend().rollback(job.job_id, job.job_dir)
    for plural in ("pods", "secrets", "configmaps", "networkpolicies"):
        assert cluster.objects(plural, job.job_id) == [], plural


def test_emulator_stop_learners_deletes_running_pods_with_the_grace(
    cluster: Cluster, emulator: Emulator, tmp_path: Path
) -> None:
    backend = cluster.backend()
    job = make_job(tmp_path)
    deploy(backend, job)
    backend.stop_learners(job.job_id, grace_s=2.5)
    assert cluster.objects("pods", job.job_id) == []
    deletes = [r for r in emulator.km._requests if str(r.method).upper().endswith("DELETE")]
    assert any(
        r.params.get("gracePeriodSeconds") == "3" or (r.data or {}).get("gracePeriodSeconds") == 3
        for r in deletes
    )


def test_get_backend_reads_its_settings_from_the_environment(
    emulator: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RHIZOME_K8S_SERVER", emulator.url)
    monkeypatch.setenv("RHIZOME_K8S_NAMESPACE", "team-a")
    backend = get_backend("kubernetes", reaper=None)
    assert isinstance(backend, KubernetesBackend)
    assert backend.namespace == "team-a"
    backend.close()


def test_malformed_settings_name_the_variable() -> None:
    from services.backends.kubernetes.api import KubeSettingsError

    with pytest.raises(KubeSettingsError, match="RHIZOME_K8S_PENDING_DEADLINE_S='soon'"):
        KubeSettings.from_environ({"RHIZOME_K8S_PENDING_DEADLINE_S": "soon"})
    with pytest.raises(KubeSettingsError, match="RHIZOME_K8S_PLATFORM_LABELS"):
        KubeSettings.from_environ({"RHIZOME_K8S_PLATFORM_LABELS": "novalue"})


_DEPLOY_THEN_HANG = """
import sys, time
from pathlib import Path
from services.backends.kubernetes.backend import KubernetesBackend
from tests.kubernetes.conftest import make_job
job = make_job(Path(sys.argv[1]), learners=3, job_id=sys.argv[2])
backend = KubernetesBackend()
backend.prepare_volume(job)
backend.write_secrets(job)
backend.start_learner(job, 0, 0)
print("started", flush=True)
time.sleep(600)  # SIGKILLed here, mid-deploy
"""


def test_emulator_process_killed_mid_deploy_leaves_no_orphan(
    cluster: Cluster, emulator: Emulator, tmp_path: Path
) -> None:
    import os
    import signal
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "RHIZOME_K8S_SERVER": emulator.url,
        "RHIZOME_K8S_NAMESPACE": cluster.settings.namespace,
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", _DEPLOY_THEN_HANG, str(tmp_path), "job-killed"],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "started"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert len(cluster.objects("pods", "job-killed")) == 1  # half a deploy was left
    cluster.backend().rollback("job-killed", "")
    for plural in ("pods", "secrets", "configmaps", "networkpolicies"):
        assert cluster.objects(plural, "job-killed") == [], plural
