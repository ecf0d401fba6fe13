"""Fixtures for the kubernetes backend and chart tests.

By default every test runs against the Kubernetes API emulator (kmock, tests/kubernetes/
emulator.py) started on a free 127.0.0.1 port and stopped at the end of the test; test
names say `emulator`. With RHIZOME_K8S_CONTEXT set, the same backend tests run against
that kubeconfig context (kind, minikube, a cloud cluster: docs/kubernetes.md) in the
namespace RHIZOME_K8S_NAMESPACE (default `rhizome-test`); the tests that need what only
the emulator can do (inject a 410, restart the API server, play the kubelet) are then
skipped with that reason, never counted as passed.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from kubernetes import client as k8s

from services.backends.api import JobSpec
from services.backends.kubernetes.api import KubeSettings
from services.backends.kubernetes.backend import KubernetesBackend
from services.manifest import parse_manifest
from tests.kubernetes.emulator import Emulator

# The Kubernetes version every created and rendered object is validated against.
K8S_VERSION = "1.37.0"
REAL_CONTEXT = os.environ.get("RHIZOME_K8S_CONTEXT", "")

pytestmark = pytest.mark.kubernetes


def validate(obj: dict[str, Any]) -> None:
    """kubernetes-validate in strict mode (unknown fields are errors) against K8S_VERSION."""
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.fixture
def emulator() -> Iterator[Emulator]:
    if REAL_CONTEXT:
        pytest.skip(f"needs the API emulator; RHIZOME_K8S_CONTEXT={REAL_CONTEXT} is a real cluster")
    emu = Emulator().start()
    try:
        yield emu
    finally:
        emu.stop()


class Cluster:
    """What a test talks to: the emulator, or a real cluster through a context."""

    def __init__(self, settings: KubeSettings, emulator: Emulator | None) -> None:
        self.settings = settings
        self.emulator = emulator
        self.backends: list[KubernetesBackend] = []

    def backend(self, **changes: Any) -> KubernetesBackend:
        backend = KubernetesBackend(replace(self.settings, **changes))
        self.backends.append(backend)
        return backend

    def api(self) -> k8s.CoreV1Api:
        from services.backends.kubernetes.client import api_client

        return k8s.CoreV1Api(api_client(self.settings))

    def objects(self, plural: str, job_id: str | None = None) -> list[dict[str, Any]]:
        """What the server holds in the test namespace (Nodes: cluster-wide), filtered by
        the job label here (the emulator ignores selectors)."""
        if self.emulator is not None:
            return self.emulator.objects(plural, job_id)
        from services.backends.kubernetes.client import api_client, json_body

        api = api_client(self.settings)
        core, net = k8s.CoreV1Api(api), k8s.NetworkingV1Api(api)
        lister = {
            "pods": core.list_namespaced_pod,
            "secrets": core.list_namespaced_secret,
            "configmaps": core.list_namespaced_config_map,
            "networkpolicies": net.list_namespaced_network_policy,
        }[plural]
        selector: dict[str, Any] = {"label_selector": f"rhizome.io/job={job_id}"} if job_id else {}
        body = json_body(lister(self.settings.namespace, _preload_content=False, **selector))
        return [
            o
            for o in body.get("items") or []
            if job_id is None or o["metadata"].get("labels", {}).get("rhizome.io/job") == job_id
        ]

    def close(self) -> None:
        for backend in self.backends:
            backend.close()


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    if REAL_CONTEXT:
        settings = KubeSettings(
            context=REAL_CONTEXT,
            namespace=os.environ.get("RHIZOME_K8S_NAMESPACE", "rhizome-test"),
            backoff_s=0.05,
        )
        found = Cluster(settings, None)
    else:
        emu: Emulator = request.getfixturevalue("emulator")
        found = Cluster(KubeSettings(server=emu.url, namespace="rz-test", backoff_s=0.01), emu)
    try:
        yield found
    finally:
        found.close()


def make_job(tmp_path: Path, manifest: str = "", learners: int = 2, **kwargs: Any) -> JobSpec:
    job_id = kwargs.pop("job_id", f"job-{uuid.uuid4().hex[:12]}")
    text = (
        "name: t\nframework:\n  command: sh run.sh\n"
        "learners: 2\ncpus: 1.5\nmemory: 512MiB\n" + manifest
    )
    fields: dict[str, Any] = {
        "job_id": job_id,
        "command": "sh run.sh",
        "learners": learners,
        "job_dir": str(tmp_path / "jobs" / job_id),
        "checkpoint_dir": str(tmp_path / "jobs" / job_id / "checkpoints"),
        "result_store": str(tmp_path / "objects" / "results" / job_id),
        "etcd_url": "http://etcd.rhizome:2379",
        "manifest": parse_manifest(text),
        "generation": 3,
        "model_zip": f"s3://rhizome/models/{job_id}.zip",
        "memory_mb": 512.0,
        "grace_s": 7.5,
        **kwargs,
    }
    return JobSpec(**fields)


def deploy(backend: KubernetesBackend, job: JobSpec) -> dict[int, int]:
    """The guardian's deploy steps, in its order."""
    backend.prepare_volume(job)
    backend.write_secrets(job)
    handles = {rank: backend.start_learner(job, rank, 0) for rank in range(job.learners)}
    backend.start_helper(job)
    return handles


def set_pod_status(
    api: k8s.CoreV1Api,
    namespace: str,
    name: str,
    phase: str,
    *,
    exit_code: int | None = None,
    reason: str = "",
    waiting: str = "",
    pod_reason: str = "",
) -> None:
    """Play the kubelet: patch a pod's status as a kubelet would report it."""
    state: dict[str, Any] = {"running": {}}
    if exit_code is not None:
        state = {"terminated": {"exitCode": exit_code, "reason": reason or "Error"}}
    elif waiting:
        state = {"waiting": {"reason": waiting, "message": f"{waiting}: test"}}
    status: dict[str, Any] = {
        "phase": phase,
        "containerStatuses": [
            {
                "name": "learner",
                "image": "x",
                "imageID": "",
                "ready": phase == "Running",
                "restartCount": 0,
                "state": state,
            }
        ],
    }
    if pod_reason:
        status["reason"] = pod_reason
    api.patch_namespaced_pod_status(name, namespace, {"status": status})
