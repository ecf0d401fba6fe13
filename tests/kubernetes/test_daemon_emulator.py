"""The daemon with `--backend kubernetes`, end to end against EMULATORS: the API server
is kmock (tests/kubernetes/emulator.py) and the kubelets are tests/kubernetes/kubelet.py,
which runs each bound pod's learner controller as a local process and reports its
status through the API. Our gang scheduler (the binder) runs in this process, as the
chart runs it beside the daemon.

A job submitted through the daemon's API is placed by the scheduler service on the
emulator's Nodes (its cluster source), its pods are created by the backend, bound by our
scheduler and run to COMPLETED; a pod deleted under a running learner gets SIGTERM and
goes through the guardian's recovery; an OOM-killed container fails the job saying so; a
daemon SIGKILLed mid-deploy leaves no orphan pod once it is back.

What this cannot show: a real kubelet (images, cgroups, the OOM killer itself), the
garbage collector, admission (docs/kubernetes.md, "What the tests cover").
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from contract import etcd_keys
from contract.etcd import EtcdClient
from contract.procs import free_port
from services.backends.kubernetes.api import KubeSettings
from services.backends.kubernetes.scheduler import GangScheduler
from services.client.sdk import Client, ClientError
from services.store import states
from services.store.jobs import JobsRepository
from services.store.mongo import connect
from tests.kubernetes.conftest import REAL_CONTEXT
from tests.kubernetes.emulator import Emulator
from tests.kubernetes.kubelet import KubeletEmulator, OomKill
from tests.kubernetes.test_scheduler_emulator import node
from tests.services.guardian.helpers import code_zip, wait_for

pytestmark = [pytest.mark.kubernetes, pytest.mark.integration]

NAMESPACE = "rz-jobs"
TERMINAL = {states.COMPLETED, states.FAILED, states.HALTED, states.DELETED}
# A learner that reports progress for STEPS seconds and exits 0; on SIGTERM it says so
# in its output and exits (the controller's emergency path runs around it).
STEPPER = (
    "trap 'echo got SIGTERM; exit 143' TERM\n"
    "i=0; while [ $i -lt ${STEPS:-1} ]; do echo step $i; i=$((i+1)); sleep 1; done\n"
)


def manifest(name: str, command: str, learners: int = 2, restarts: int = 2) -> str:
    return (
        f"name: {name}\nlearners: {learners}\nmemory: 256MiB\ncpus: 0.5\n"
        f"max_learner_restarts: {restarts}\nframework:\n  command: {command!r}\n"
    )


class K8sPlatform:
    """`rhizomed --backend kubernetes` (api, lcm, scheduler) on the emulator, our
    binder in a thread, and the kubelet emulator."""

    def __init__(self, tmp: Path, etcd_url: str, mongo_url: str, emulator: Emulator) -> None:
        self.tmp = tmp
        self.emulator = emulator
        self.mongo_url = mongo_url
        self.port, self.rest = free_port(), free_port()
        self.settings = KubeSettings(server=emulator.url, namespace=NAMESPACE, backoff_s=0.05)
        self.args = [
            f"--mongodb-uri={mongo_url}",
            f"--etcd={etcd_url}",
            "--services=api,lcm,scheduler",
            "--backend=kubernetes",
            f"--admin-token-file={tmp / 'daemon' / 'admin.token'}",
        ]
        self.env = {
            "RHIZOME_K8S_SERVER": emulator.url,
            "RHIZOME_K8S_NAMESPACE": NAMESPACE,
            "RHIZOME_LEARNER_GRACE_S": "3",
        }
        self.server: Any = None
        self.kubelet = KubeletEmulator(self.settings, tmp / "nodes")
        self.binder = GangScheduler(self.settings)
        self._stop_binder = threading.Event()
        self._binder_thread = threading.Thread(
            target=self.binder.run, args=(self._stop_binder, 0.1), daemon=True
        )
        self.db = connect(mongo_url)
        self.jobs = JobsRepository(self.db)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self) -> Client:
        token = (self.tmp / "daemon" / "admin.token").read_text().strip()
        return Client(self.address, token=token)

    def start_daemon(self, **env: str) -> None:
        from services.embedded.platform import DaemonServer

        wanted = {**self.env, **env}
        saved = {k: os.environ.get(k) for k in wanted}
        os.environ.update(wanted)  # the daemon and its guardians inherit them
        try:
            self.server = DaemonServer(self.tmp / "daemon", self.port, self.rest, self.args)
            # The shared test machine can be slow to import and serve: not a failure.
            self.server.start_timeout_s = 120
            self.server.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def start(self, **env: str) -> None:
        self.kubelet.start()
        self._binder_thread.start()
        self.start_daemon(**env)

    def kill_daemon(self) -> None:
        assert self.server is not None and self.server.pid is not None
        self.server.kill(whole_group=False)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(timeout_s=30)
        self._stop_binder.set()
        self._binder_thread.join(timeout=10)
        self.binder.close()
        self.kubelet.stop()
        self.db.client.close()

    def wait_status(self, job_id: str, wanted: set[str], timeout: float = 120) -> Any:
        wait_for(
            f"{job_id} to be {sorted(wanted)}",
            lambda: self.jobs.get(job_id).status in wanted,
            timeout,
        )
        return self.jobs.get(job_id)

    def pods(self, job_id: str | None = None) -> list[dict[str, Any]]:
        return self.emulator.objects("pods", job_id)


@pytest.fixture
def platform(
    etcd_server: Any, mongo_server: Any, emulator: Emulator, tmp_path: Path
) -> Iterator[K8sPlatform]:
    if REAL_CONTEXT:
        pytest.skip("plays the kubelet: needs the API emulator, not a real cluster")
    api = emulator
    from kubernetes import client as k8s

    from services.backends.kubernetes.client import api_client

    core = k8s.CoreV1Api(api_client(KubeSettings(server=api.url, namespace=NAMESPACE)))
    core.create_node(
        node("node-a", cpu="2", memory="4Gi", labels={"topology.kubernetes.io/zone": "za"})
    )
    core.create_node(
        node("node-b", cpu="2", memory="4Gi", labels={"topology.kubernetes.io/zone": "zb"})
    )
    emulator.km.graceful_pods = True  # the kubelet emulator finishes pod deletions
    found = K8sPlatform(tmp_path, etcd_server.url, mongo_server.url, emulator)
    try:
        yield found
    finally:
        found.stop()


def test_emulator_daemon_job_runs_in_pods_bound_by_our_scheduler_to_completed(
    platform: K8sPlatform,
) -> None:
    platform.start()
    with platform.client() as c:
        # Admission reads the same Nodes: 3 CPUs per learner fit on no 2-CPU node.
        with pytest.raises(ClientError) as info:
            c.create_job(
                manifest("k8s-huge", "sh run.sh").replace("cpus: 0.5", "cpus: 3"),
                code_zip({"run.sh": STEPPER}),
            )
        assert "can never run on this cluster" in info.value.message
        job_id = c.create_job(
            manifest("k8s-e2e", "STEPS=1 sh run.sh"), code_zip({"run.sh": STEPPER})
        ).job_id
    record = platform.wait_status(job_id, TERMINAL, 180)
    assert record.status == states.COMPLETED, record.status_message
    # Placed by the scheduler service on the emulator's Nodes (its cluster source) ...
    placed = set(record.placement["learner_nodes"].values())
    assert placed <= {"node-a", "node-b"}
    # ... and each learner pod bound once, by our binder, through the Binding subresource.
    bound = [pod for pod, _ in platform.emulator.km.bindings if job_id in pod]
    assert len(bound) == 2 and len(set(bound)) == 2
    # ... on the very nodes the scheduler service recorded (the binder honours them).
    nodes = sorted(node for pod, node in platform.emulator.km.bindings if job_id in pod)
    assert nodes == sorted(record.placement["learner_nodes"].values())
    # (this job's pods only: the kubelet emulator serves the module's whole cluster)
    assert sorted(p for p in platform.kubelet.started if job_id in p) == sorted(bound)
    # The learners' own command ran in each pod (the kubelet emulator's process).
    for pod in bound:
        assert "step 0" in platform.kubelet.output(pod), pod
    # The job's objects are gone once it ended (rollback by label).
    wait_for("the job's pods removed", lambda: platform.pods(job_id) == [], 30)


def test_emulator_pod_deleted_gets_sigterm_and_the_guardian_restarts_it(
    platform: K8sPlatform,
) -> None:
    platform.start()
    with platform.client() as c:
        job_id = c.create_job(
            manifest("k8s-delete", "STEPS=6 sh run.sh", learners=1),
            code_zip({"run.sh": STEPPER}),
        ).job_id
    first = wait_for(
        "the learner's pod running",
        lambda: next(
            (p for p in platform.pods(job_id) if (p.get("status") or {}).get("phase") == "Running"),
            None,
        ),
        120,
    )
    name = first["metadata"]["name"]
    wait_for("the learner's command running", lambda: "step 0" in platform.kubelet.output(name), 60)
    from kubernetes import client as k8s

    from services.backends.kubernetes.client import api_client

    k8s.CoreV1Api(api_client(platform.settings)).delete_namespaced_pod(name, NAMESPACE)
    wait_for("the kubelet's SIGTERM", lambda: platform.kubelet.signals.get(name), 30)
    # SIGTERM first, within the pod's grace period, and it reached the learner's command.
    assert platform.kubelet.signals[name] == ["SIGTERM"]
    wait_for(
        "the command's SIGTERM trap", lambda: "got SIGTERM" in platform.kubelet.output(name), 30
    )
    record = platform.wait_status(job_id, TERMINAL, 180)
    assert record.status == states.COMPLETED, record.status_message
    runs = [p for p in platform.kubelet.started if job_id in p]
    assert len(runs) >= 2, "the guardian started the learner again in a new pod"


def test_emulator_oom_killed_container_fails_the_job_saying_so(platform: K8sPlatform) -> None:
    # The learner's command is SIGKILLed mid-run as the OOM killer would, and the
    # container's end reported OOMKilled (the OOM killer itself is the kernel's and the
    # cgroup's business: the kubelet emulator plays it).
    platform.kubelet.default_outcome = OomKill(when_output="step 0")
    platform.start()
    with platform.client() as c:
        job_id = c.create_job(
            manifest("k8s-oom", "STEPS=30 sh run.sh", learners=1, restarts=0),
            code_zip({"run.sh": STEPPER}),
        ).job_id
    record = platform.wait_status(job_id, TERMINAL, 180)
    assert record.status == states.FAILED
    assert record.status_message.startswith("learner 0 exited with code 137"), record.status_message
    assert "out of memory: the learner's pod hit its memory limit of 256Mi (OOM kill)" in (
        record.status_message
    )


def test_emulator_daemon_sigkilled_mid_deploy_leaves_no_orphan_pod(
    platform: K8sPlatform, etcd_server: Any
) -> None:
    etcd = EtcdClient.connect(etcd_server.url)
    platform.start(RHIZOME_GUARDIAN_STEP_DELAY_S="1.0")
    try:
        with platform.client() as c:
            job_id = c.create_job(
                manifest("k8s-middeploy", "STEPS=2 sh run.sh"), code_zip({"run.sh": STEPPER})
            ).job_id
        helper = etcd_keys.deploy_step(job_id, "helper")
        wait_for("the helper step to start", lambda: etcd.get(helper), 120)
        assert len(platform.pods(job_id)) == 2
        guardian = etcd.get(etcd_keys.guardian_lease(job_id))
        assert guardian is not None
        platform.kill_daemon()
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(guardian.value["pid"]), signal.SIGKILL)
        platform.start_daemon()
        record = platform.wait_status(job_id, TERMINAL, 180)
        assert record.status == states.COMPLETED, record.status_message
        wait_for("no pod of the job", lambda: platform.pods(job_id) == [], 30)
        # No pod in the jobs' namespace belongs to a job that is not active any more.
        for pod in platform.pods():
            owner = pod["metadata"]["labels"].get("rhizome.io/job", "")
            assert platform.jobs.get(owner).status not in TERMINAL, pod["metadata"]["name"]
    finally:
        etcd.close()
