"""What a job is on Kubernetes: pure functions of the job that return the objects' JSON.

One ConfigMap `rz-<job>` is the job's owner object: every other object of the job (its
Secrets, NetworkPolicy, Pods) carries an owner reference to it, so deleting it cascades
through the garbage collector even if the platform never comes back. Everything is also
labelled `rhizome.io/job`, which is what rollback deletes by.

A learner pod runs `python -m learner.controller` as uid 10001 with a read-only root
filesystem, no capabilities, no service-account token, and `schedulerName: rhizome` so
that only our gang scheduler binds it. Its learner spec (the same `LearnerSpec` the local
backend writes to disk) and the job's data-store credentials come from Secrets mounted
read-only (mode 0400); code and checkpoints come from the object store named in the spec,
so the pod needs no host path.

On a TLS platform the job's TDS client certificate is also the Secret `rz-<job>-tds-tls`
(`tds-tls.json`), mounted as a directory (never `subPath`: the kubelet refreshes a Secret
volume in a running pod, a subPath mount never), and the controller is told where
(`contract.credentials.TDS_TLS_DIR_ENV`): the guardian's renewal patches the Secret, the
kubelet projects the new file, and the controller's log collector re-reads it.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from contract.credentials import TDS_TLS_DIR_ENV, TDS_TLS_FILE
from contract.env import Role
from contract.learner_spec import LearnerSpec
from services.backends.api import JobSpec
from services.backends.kubernetes.api import SCHEDULER_NAME
from services.backends.local.backend import learner_spec
from services.images.build import LEARNER_HOME, LEARNER_UID

LABEL_JOB = "rhizome.io/job"
LABEL_RANK = "rhizome.io/rank"
LABEL_GENERATION = "rhizome.io/generation"
LABEL_RESTART = "rhizome.io/restart"
LABEL_ROLE = "rhizome.io/role"
# What our scheduler reads from a pending pod: the gang's size, its GPU type (matched
# against the nodes' label of the same name) and whether stages want distinct zones.
LABEL_LEARNERS = "rhizome.io/learners"
LABEL_GPU_TYPE = "rhizome.io/gpu-type"
LABEL_ZONE_AWARE = "rhizome.io/zone-aware"
# The node the platform's scheduler service chose for a learner (the job's recorded
# placement); our binder honours it when the node is still there and the pod fits.
ANNOTATION_NODE = "rhizome.io/scheduled-node"
MANAGED_BY = {"app.kubernetes.io/managed-by": "rhizome", "app.kubernetes.io/component": "learner"}
GPU_RESOURCE = "nvidia.com/gpu"
CONTAINER = "learner"
# Where things are inside a learner pod: its job directory is an emptyDir (logs, code
# extracted by the controller); the spec and the secrets are Secret volumes.
POD_JOB_DIR = "/var/lib/rhizome/job"
POD_SPEC_DIR = "/etc/rhizome/learner"
POD_SECRETS_DIR = f"{POD_JOB_DIR}/secrets"
# The job's TDS certificate Secret: outside the job directory (a volume of its own, which
# the kubelet swaps atomically when the Secret changes).
POD_TDS_TLS_DIR = "/etc/rhizome/tds-tls"
SECRET_MODE = 0o400


def owner_name(job_id: str) -> str:
    return f"rz-{job_id}"


def secrets_name(job_id: str) -> str:
    return f"rz-{job_id}-secrets"


def tds_tls_name(job_id: str) -> str:
    return f"rz-{job_id}-tds-tls"


def policy_name(job_id: str) -> str:
    return f"rz-{job_id}"


def pod_name(job_id: str, rank: int, generation: int, restart: int) -> str:
    return f"rz-{job_id}-{rank}-g{generation}-r{restart}"


def spec_secret_name(job_id: str, rank: int, generation: int, restart: int) -> str:
    return f"{pod_name(job_id, rank, generation, restart)}-spec"


def job_selector(job_id: str, rank: int | None = None) -> str:
    """The label selector of a job's objects (and of one rank's pods)."""
    sel = f"{LABEL_JOB}={job_id}"
    return sel if rank is None else f"{sel},{LABEL_RANK}={rank}"


def handle_of(name: str) -> int:
    """The guardian's int handle for a pod: 60 bits of its name's digest (stable across
    restarts of the guardian, unlike a counter)."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:15], 16)


def job_labels(job_id: str) -> dict[str, str]:
    return {LABEL_JOB: job_id, "app.kubernetes.io/managed-by": "rhizome"}


def _meta(
    name: str, namespace: str, labels: Mapping[str, str], owner: Mapping[str, Any] | None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if owner is not None:
        meta["ownerReferences"] = [dict(owner)]
    return meta


def owner_object(job: JobSpec, namespace: str) -> dict[str, Any]:
    """The per-job ConfigMap every other object of the job is owned by."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(owner_name(job.job_id), namespace, job_labels(job.job_id), None),
        "data": {"job": job.job_id, "generation": str(job.generation)},
    }


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    """A reference to the job's owner ConfigMap as the server returned it (with its uid)."""
    meta = owner.get("metadata") or {}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": str(meta.get("name", "")),
        "uid": str(meta.get("uid", "")),
        "blockOwnerDeletion": True,
    }


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def secrets_object(job: JobSpec, namespace: str, owner: Mapping[str, Any] | None) -> dict[str, Any]:
    """The job's data-store credentials, as the local backend's `secrets/env` file."""
    lines = []
    for store in job.manifest.data_stores:
        for key, value in sorted(store.connection.items()):
            lines.append(f"{store.id}_{key}".upper().replace("-", "_") + f"={value}")
    text = "\n".join(lines) + ("\n" if lines else "")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _meta(secrets_name(job.job_id), namespace, job_labels(job.job_id), owner),
        "data": {"env": _b64(text)},
    }


def tds_tls_data(tls: Mapping[str, str]) -> dict[str, str]:
    """A TDS client certificate (`{ca, cert, key}`) as the TLS Secret's data: the file
    the collector reads (contract.credentials.TDS_TLS_FILE)."""
    return {TDS_TLS_FILE: _b64(json.dumps(dict(tls), sort_keys=True))}


def tds_tls_object(job: JobSpec, namespace: str, owner: Mapping[str, Any] | None) -> dict[str, Any]:
    """The job's TDS client certificate, which `renew_tls` replaces in running pods."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _meta(tds_tls_name(job.job_id), namespace, job_labels(job.job_id), owner),
        "data": tds_tls_data(job.tds_tls),
    }


def pod_learner_spec(job: JobSpec, rank: int, restart: int) -> LearnerSpec:
    """The local backend's learner spec with the pod's own paths: the job directory is the
    pod's emptyDir, results go under it until the controller stores them."""
    inside = dataclasses.replace(
        job,
        job_dir=POD_JOB_DIR,
        checkpoint_dir=f"{POD_JOB_DIR}/checkpoints",
        result_store=f"{POD_JOB_DIR}/results",
    )
    spec = learner_spec(inside, rank, restart)
    # The scheduler gives each pod its GPUs: inside, they are always 0..n-1.
    gpus = int(job.gpus_per_learner)
    spec.env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus)) if gpus else ""
    return spec


def spec_secret_object(
    job: JobSpec,
    rank: int,
    restart: int,
    namespace: str,
    owner: Mapping[str, Any] | None,
) -> dict[str, Any]:
    spec = pod_learner_spec(job, rank, restart)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _meta(
            spec_secret_name(job.job_id, rank, job.generation, restart),
            namespace,
            {**job_labels(job.job_id), LABEL_RANK: str(rank)},
            owner,
        ),
        "data": {"spec.json": _b64(spec.to_json())},
    }


def quantity_mb(mb: float) -> str:
    return f"{int(mb)}Mi" if float(mb).is_integer() else f"{int(mb * 1024)}Ki"


def quantity_cpus(cpus: float) -> str:
    millis = round(cpus * 1000)
    return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"


def resources(job: JobSpec) -> dict[str, dict[str, str]]:
    """Requests equal limits (the Guaranteed class for CPU and memory): the scheduler
    placed the gang on exactly these amounts. GPUs as `nvidia.com/gpu` (limits only are
    required; Kubernetes copies them to requests)."""
    out: dict[str, str] = {}
    cpus = job.manifest.resources.cpus
    if cpus > 0:
        out["cpu"] = quantity_cpus(cpus)
    if job.memory_mb > 0:
        out["memory"] = quantity_mb(job.memory_mb)
    gpus = int(job.gpus_per_learner)
    if gpus > 0:
        out[GPU_RESOURCE] = str(gpus)
    return {"requests": dict(out), "limits": dict(out)} if out else {}


def pod_object(
    job: JobSpec,
    rank: int,
    restart: int,
    namespace: str,
    image: str,
    owner: Mapping[str, Any] | None,
) -> dict[str, Any]:
    name = pod_name(job.job_id, rank, job.generation, restart)
    labels = {
        **MANAGED_BY,
        LABEL_JOB: job.job_id,
        LABEL_RANK: str(rank),
        LABEL_GENERATION: str(job.generation),
        LABEL_RESTART: str(restart),
        LABEL_ROLE: Role.CONTROLLER.value,
        LABEL_LEARNERS: str(job.learners),
    }
    if int(job.gpus_per_learner) > 0 and job.manifest.resources.gpu_type:
        labels[LABEL_GPU_TYPE] = job.manifest.resources.gpu_type
    if job.manifest.pipeline is not None:
        labels[LABEL_ZONE_AWARE] = "true"
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-m", "learner.controller", "--spec", f"{POD_SPEC_DIR}/spec.json"],
        "workingDir": POD_JOB_DIR,
        "env": [
            {"name": "HOME", "value": LEARNER_HOME},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": LEARNER_UID,
            "runAsGroup": LEARNER_UID,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "job", "mountPath": POD_JOB_DIR},
            {"name": "spec", "mountPath": POD_SPEC_DIR, "readOnly": True},
            {"name": "secrets", "mountPath": POD_SECRETS_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "home", "mountPath": LEARNER_HOME},
        ],
    }
    volumes: list[dict[str, Any]] = [
        {"name": "job", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        {"name": "home", "emptyDir": {"sizeLimit": "256Mi"}},
        {
            "name": "spec",
            "secret": {
                "secretName": spec_secret_name(job.job_id, rank, job.generation, restart),
                "defaultMode": SECRET_MODE,
            },
        },
        {
            "name": "secrets",
            "secret": {"secretName": secrets_name(job.job_id), "defaultMode": SECRET_MODE},
        },
    ]
    if job.tds_tls:
        # A directory mount (no subPath), so that a renewal reaches the running pod.
        container["volumeMounts"].append(
            {"name": "tds-tls", "mountPath": POD_TDS_TLS_DIR, "readOnly": True}
        )
        container["env"].append({"name": TDS_TLS_DIR_ENV, "value": POD_TDS_TLS_DIR})
        volumes.append(
            {
                "name": "tds-tls",
                "secret": {"secretName": tds_tls_name(job.job_id), "defaultMode": SECRET_MODE},
            }
        )
    res = resources(job)
    if res:
        container["resources"] = res
    tolerations = []
    if int(job.gpus_per_learner) > 0:
        # GPU nodes are commonly tainted so that only pods asking for GPUs land there.
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    meta = _meta(name, namespace, labels, owner)
    chosen = (job.placement.get("learner_nodes") or {}).get(str(rank))
    if chosen:
        meta["annotations"] = {ANNOTATION_NODE: str(chosen)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            **({"tolerations": tolerations} if tolerations else {}),
            "schedulerName": SCHEDULER_NAME,
            "restartPolicy": "Never",  # the guardian restarts learners, counting them
            "terminationGracePeriodSeconds": max(1, int(job.grace_s + 0.999)),
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "hostname": f"learner-{rank}",
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": LEARNER_UID,
                "runAsGroup": LEARNER_UID,
                "fsGroup": LEARNER_UID,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [container],
            "volumes": volumes,
        },
    }


def network_policy_object(
    job: JobSpec,
    namespace: str,
    platform_labels: Mapping[str, str],
    owner: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The job's learners talk to each other and to the platform's pods (etcd, the TDS),
    and resolve names; nothing else reaches them and they reach nothing else."""
    peers = {"podSelector": {"matchLabels": {LABEL_JOB: job.job_id}}}
    platform = {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": dict(platform_labels)},
    }
    dns = {
        "to": [
            {
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": "kube-system"}
                },
                "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
            }
        ],
        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(policy_name(job.job_id), namespace, job_labels(job.job_id), owner),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_JOB: job.job_id}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [peers]}],
            "egress": [{"to": [peers]}, {"to": [platform]}, dns],
        },
    }
