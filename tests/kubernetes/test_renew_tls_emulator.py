"""A running Kubernetes learner gets its renewed TDS client certificate (issue #15),
against EMULATORS: the API server is kmock (tests/kubernetes/emulator.py) and the
kubelet is tests/kubernetes/kubelet.py, which projects Secret volumes and refreshes them
while a pod runs as a kubelet does (a new `..<stamp>` directory, `..data` swapped).

The job's certificate is the Secret `rz-<job>-tds-tls` (valid against the official
schemas, owned by the job's ConfigMap), mounted as a directory (never `subPath`, which a
kubelet never refreshes); `renew_tls` patches it, retried like every call, and a Secret
that is gone is a BackendError naming the job. End to end, a learner pod started with an
expired certificate (refused by the TDS's mutual TLS) ships its logs once the renewed one
is projected, by the same pod and process, and goes on shipping.

What this cannot show: a real kubelet's sync period (about a minute) and fsGroup
ownership of the projected files (docs/kubernetes.md, "What the tests cover").
"""

from __future__ import annotations

import base64
import datetime
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rhizome.v1 import tds_pb2

from contract.credentials import TDS_TLS_DIR_ENV, TDS_TLS_FILE, tds_tls_file
from learner.controller.tds_channel import RenewingStub
from services.backends.api import BackendError
from services.backends.kubernetes.backend import KubernetesBackend
from services.backends.kubernetes.scheduler import GangScheduler
from services.backends.kubernetes.spec import (
    POD_JOB_DIR,
    POD_TDS_TLS_DIR,
    owner_name,
    pod_name,
    tds_tls_name,
)
from services.daemon import Daemon
from services.embedded.process import ManagedServer
from services.security.tls import InternalTls
from tests.kubernetes.conftest import Cluster, deploy, make_job, validate
from tests.kubernetes.emulator import Emulator
from tests.kubernetes.kubelet import KubeletEmulator
from tests.services.guardian.helpers import wait_for
from tests.services.tds.helpers import mutual_tls_tds

pytestmark = pytest.mark.kubernetes

FIRST = {"ca": "CA PEM", "cert": "FIRST CERT", "key": "FIRST KEY"}
RENEWED = {"ca": "CA PEM", "cert": "RENEWED CERT", "key": "RENEWED KEY"}


def tls_secret(cluster: Cluster, job_id: str) -> dict[str, Any]:
    (found,) = [
        s
        for s in cluster.objects("secrets", job_id)
        if s["metadata"]["name"] == tds_tls_name(job_id)
    ]
    return found


def certificate_in(secret: dict[str, Any]) -> dict[str, str]:
    return dict(json.loads(base64.b64decode(secret["data"][TDS_TLS_FILE])))


def test_emulator_tds_tls_secret_is_valid_owned_and_mounted_as_a_directory(
    cluster: Cluster, tmp_path: Path
) -> None:
    backend = cluster.backend()
    job = make_job(tmp_path, tds_tls=FIRST)
    deploy(backend, job)

    secret = tls_secret(cluster, job.job_id)
    validate(secret)
    assert certificate_in(secret) == FIRST
    (owner,) = cluster.objects("configmaps", job.job_id)
    (ref,) = secret["metadata"]["ownerReferences"]  # deleting the ConfigMap cascades
    assert (ref["kind"], ref["name"]) == ("ConfigMap", owner_name(job.job_id))
    assert ref["uid"] == owner["metadata"]["uid"]
    pods = cluster.objects("pods", job.job_id)
    assert len(pods) == 2
    for pod in pods:
        validate(pod)
        assert "FIRST KEY" not in json.dumps(pod)  # the key lives in the Secret only
        (container,) = pod["spec"]["containers"]
        # No subPath anywhere: a kubelet never refreshes a subPath mount.
        assert not any("subPath" in m or "subPathExpr" in m for m in container["volumeMounts"])
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["tds-tls"] == {
            "name": "tds-tls",
            "mountPath": POD_TDS_TLS_DIR,
            "readOnly": True,
        }
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["tds-tls"]["secret"] == {
            "secretName": tds_tls_name(job.job_id),
            "defaultMode": 0o400,
        }
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env[TDS_TLS_DIR_ENV] == POD_TDS_TLS_DIR
        # The collector's one lookup finds the mounted file from the pod's environment;
        # without it (the local and docker backends) the learner directory's.
        learner = Path(POD_JOB_DIR, "learners", "0")
        assert tds_tls_file(learner, env) == Path(POD_TDS_TLS_DIR, TDS_TLS_FILE)
        assert tds_tls_file(learner, {}) == learner / TDS_TLS_FILE

    backend.rollback(job.job_id, job.job_dir)
    assert cluster.objects("secrets", job.job_id) == []


def test_emulator_no_tds_tls_secret_on_a_plaintext_platform(
    cluster: Cluster, tmp_path: Path
) -> None:
    job = make_job(tmp_path, learners=1)  # no certificate: the TDS's port is plaintext
    deploy(cluster.backend(), job)
    names = {s["metadata"]["name"] for s in cluster.objects("secrets", job.job_id)}
    assert tds_tls_name(job.job_id) not in names
    (pod,) = cluster.objects("pods", job.job_id)
    (container,) = pod["spec"]["containers"]
    assert "tds-tls" not in {m["name"] for m in container["volumeMounts"]}
    assert TDS_TLS_DIR_ENV not in {e["name"] for e in container["env"]}


def test_emulator_renew_tls_patches_the_secret_through_429_500_and_409(
    cluster: Cluster, emulator: Emulator, tmp_path: Path
) -> None:
    backend = cluster.backend()
    assert backend.renews_tls  # so the LCM issues 24 h certificates (services/lcm/hosting.py)
    job = make_job(tmp_path, learners=1, tds_tls=FIRST)
    deploy(backend, job)
    before = backend.calls.retries
    emulator.km.fail_only = "secrets"  # the backend's pod watch must not take them
    emulator.km.fail_next = [429, 500, 409]  # throttled, a server error, a racing update
    backend.renew_tls(job, RENEWED)
    assert backend.calls.retries - before == 3
    secret = tls_secret(cluster, job.job_id)
    validate(secret)
    assert certificate_in(secret) == RENEWED
    assert secret["metadata"]["labels"]["rhizome.io/job"] == job.job_id  # a patch, not a put


def test_emulator_renew_tls_without_its_secret_is_a_backend_error_naming_the_job(
    cluster: Cluster, emulator: Emulator, tmp_path: Path
) -> None:
    backend = cluster.backend()
    job = make_job(tmp_path, learners=1, tds_tls=FIRST)
    deploy(backend, job)
    emulator.km.fail_only = "secrets"  # the backend's pod watch must not take it
    emulator.km.fail_next = [403]  # not retried: the server's refusal, said
    with pytest.raises(BackendError, match=rf"job {job.job_id}: .*refused: HTTP 403"):
        backend.renew_tls(job, RENEWED)
    backend.rollback(job.job_id, job.job_dir)
    with pytest.raises(BackendError, match=rf"job {job.job_id}: .*Secret is gone"):
        backend.renew_tls(job, RENEWED)


@pytest.mark.integration
def test_emulator_kubelet_refreshes_a_renewed_secret_in_a_running_pod_atomically(
    cluster: Cluster, etcd_server: ManagedServer, tmp_path: Path
) -> None:
    """The emulator's own contract, which the end-to-end test relies on: a changed
    Secret is projected again into the running pod, `..data` swapped to a new directory,
    the key a link through it; a subPath mount would be refused."""
    backend = cluster.backend()
    job = make_job(
        tmp_path,
        learners=1,
        tds_tls=FIRST,
        model_zip="",
        command="sleep 60",
        etcd_url=etcd_server.url,  # the controller registers there, then runs the command
    )
    deploy(backend, job)
    kubelet = KubeletEmulator(cluster.settings, tmp_path / "nodes")
    kubelet.start()
    try:
        pod = pod_name(job.job_id, 0, job.generation, 0)
        GangScheduler(cluster.settings).bind_gang(cluster.settings.namespace, {pod: "n0"})
        wait_for("the pod to run", lambda: kubelet.process(pod) is not None)
        volume = kubelet.secret_volume(pod, "tds-tls")
        seen = volume.into / TDS_TLS_FILE
        assert json.loads(seen.read_text()) == FIRST
        assert seen.is_symlink() and (volume.into / "..data").is_symlink()
        first_dir = (volume.into / "..data").resolve()
        backend.renew_tls(job, RENEWED)
        wait_for("the renewed projection", lambda: json.loads(seen.read_text()) == RENEWED)
        assert (volume.into / "..data").resolve() != first_dir and not first_dir.exists()
        assert kubelet.started == [pod]  # the same pod, never restarted
    finally:
        kubelet.stop()


# -- end to end: a learner pod shipping its logs to a mutual-TLS TDS -----------------------
JOB = "job-k8s-renew"


@pytest.fixture(scope="module")
def tds(
    mongo_server: ManagedServer, es_server: ManagedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Daemon, InternalTls, str]]:
    """The daemon's TDS alone, its internal port mutual TLS (the platform's own CA)."""
    data_dir = Path(tmp_path_factory.mktemp("k8s-renew"))
    with mutual_tls_tds(mongo_server.url, es_server.url, data_dir, "k8s_renew", JOB) as running:
        yield running


def stored_lines(address: str, token: str, ca: InternalTls, none: Path) -> int:
    """How many stdout lines of learner 0 the TDS holds (asked with a valid certificate)."""
    stub = RenewingStub(address, token, ca.job_credentials(JOB), none)
    try:
        wanted = tds_pb2.SeqRange(key="stdout", from_seq=0, to_seq=1 << 40)
        answer = stub.CountStored(
            tds_pb2.CountStoredRequest(job_id=JOB, learner=0, log_ranges=[wanted]), timeout=10
        )
        return int(answer.log_counts[0])
    finally:
        stub.close()


@pytest.mark.integration
def test_emulator_running_learner_ships_logs_with_a_renewed_certificate_without_restart(
    cluster: Cluster,
    etcd_server: ManagedServer,
    tds: tuple[Daemon, InternalTls, str],
    tmp_path: Path,
) -> None:
    daemon, ca, token = tds
    address = daemon.config.internal_address
    # The certificate the pod starts with has expired (signed by the right CA, with the
    # right token): the TDS refuses it in the handshake, so nothing ships until renewal.
    expired = ca.job_credentials(JOB, valid=datetime.timedelta(minutes=-1))
    job = make_job(
        tmp_path,
        learners=1,
        job_id=JOB,
        model_zip="",  # no code to fetch: the command is the whole learner
        command="i=0; while true; do echo line $i; i=$((i+1)); sleep 0.2; done",
        etcd_url=etcd_server.url,
        tds_address=address,
        tds_token=token,
        tds_tls=expired,
    )
    backend: KubernetesBackend = cluster.backend()
    kubelet = KubeletEmulator(cluster.settings, tmp_path / "nodes")
    kubelet.start()
    none = tmp_path / "no-renewal.json"
    pod = pod_name(JOB, 0, job.generation, 0)

    def explain() -> str:
        return f"the pod's output:\n{kubelet.output(pod)[-3000:]}"

    try:
        deploy(backend, job)
        GangScheduler(cluster.settings).bind_gang(cluster.settings.namespace, {pod: "n0"})
        wait_for("the learner's output", lambda: "line 3" in kubelet.output(pod), 60, explain)
        # Written, not shipped: the expired certificate is refused.
        assert stored_lines(address, token, ca, none) == 0
        proc = kubelet.process(pod)
        assert proc is not None

        backend.renew_tls(job, ca.job_credentials(JOB))

        shipped = wait_for(
            "logs shipped with the renewal",
            lambda: stored_lines(address, token, ca, none),
            60,
            explain,
        )
        # It goes on shipping with the renewed certificate, from the same pod and process.
        wait_for(
            "more lines shipped",
            lambda: stored_lines(address, token, ca, none) > shipped,
            60,
            explain,
        )
        assert kubelet.started == [pod] and kubelet.process(pod) is proc
        assert proc.poll() is None
        assert kubelet.secret_volume(pod, "tds-tls").projections == 2  # projected, renewed
    finally:
        kubelet.stop()
        backend.rollback(JOB, job.job_dir)
