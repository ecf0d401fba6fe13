"""The kubernetes backend's interface: its settings, the API it talks to, its errors.

Every setting comes from the daemon's environment (the LCM passes it on to each guardian,
as `DOCKER_HOST` for the docker backend), so `get_backend("kubernetes")` needs no
arguments:

| variable | meaning | default |
| --- | --- | --- |
| `RHIZOME_K8S_CONTEXT` | the kubeconfig context to use (`KUBECONFIG` names the file) | in-cluster, else the current context |
| `RHIZOME_K8S_SERVER` | a plain API URL instead (`kubectl proxy`, the test emulator): no credentials | unset |
| `RHIZOME_K8S_NAMESPACE` | the namespace the jobs' objects live in | `rhizome-jobs` |
| `RHIZOME_K8S_IMAGE` | the learner image (a manifest's `framework.image` wins) | `rhizome-learner:<version>` |
| `RHIZOME_K8S_PENDING_DEADLINE_S` | a learner pod still Pending after this fails with its reason | 300 |
| `RHIZOME_K8S_PLATFORM_LABELS` | labels of the platform's pods, which learners may reach (`k=v,k=v`) | `app.kubernetes.io/name=rhizome` |
"""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.backends.api import BackendError

DEFAULT_NAMESPACE = "rhizome-jobs"
DEFAULT_PENDING_DEADLINE_S = 300.0
DEFAULT_PLATFORM_LABELS = {"app.kubernetes.io/name": "rhizome"}
SCHEDULER_NAME = "rhizome"


class KubernetesBackendError(BackendError):
    """A deploy step on Kubernetes failed; the message says what and how to fix it."""


class ApiUnreachable(KubernetesBackendError):
    """The API server did not answer (or kept answering 429/5xx) after every retry."""


class ObjectClash(KubernetesBackendError):
    """An object of the name we need exists and belongs to someone else."""


class KubeSettingsError(KubernetesBackendError, ValueError):
    """A RHIZOME_K8S_* variable is malformed; the message names it."""


def parse_labels(text: str, where: str) -> dict[str, str]:
    """`k=v,k=v` into a dict, or a KubeSettingsError naming `where`."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise KubeSettingsError(f"{where}={text!r}: write labels as key=value,key=value")
        out[key.strip()] = value.strip()
    return out


@dataclass(frozen=True)
class KubeSettings:
    namespace: str = DEFAULT_NAMESPACE
    context: str = ""
    server: str = ""
    image: str = ""
    pending_deadline_s: float = DEFAULT_PENDING_DEADLINE_S
    platform_labels: Mapping[str, str] = field(
        default_factory=lambda: dict(DEFAULT_PLATFORM_LABELS)
    )
    # API calls: how often a 429/5xx/connection failure is retried, and the first delay.
    attempts: int = 6
    backoff_s: float = 0.1

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> KubeSettings:
        env = os.environ if environ is None else environ
        raw_deadline = env.get("RHIZOME_K8S_PENDING_DEADLINE_S", "")
        deadline = DEFAULT_PENDING_DEADLINE_S
        if raw_deadline:
            try:
                deadline = float(raw_deadline)
            except ValueError:
                deadline = -1.0
            if not deadline > 0:
                raise KubeSettingsError(
                    f"RHIZOME_K8S_PENDING_DEADLINE_S={raw_deadline!r}: use seconds > 0"
                )
        labels = env.get("RHIZOME_K8S_PLATFORM_LABELS", "")
        return cls(
            namespace=env.get("RHIZOME_K8S_NAMESPACE", "") or DEFAULT_NAMESPACE,
            context=env.get("RHIZOME_K8S_CONTEXT", ""),
            server=env.get("RHIZOME_K8S_SERVER", ""),
            image=env.get("RHIZOME_K8S_IMAGE", ""),
            pending_deadline_s=deadline,
            platform_labels=parse_labels(labels, "RHIZOME_K8S_PLATFORM_LABELS")
            if labels
            else dict(DEFAULT_PLATFORM_LABELS),
        )


class PodBinder(abc.ABC):
    """Binds a gang of pending pods to nodes: all of them, or none."""

    @abc.abstractmethod
    def bind_gang(self, namespace: str, placement: Mapping[str, str]) -> None:
        """`placement` maps pod name -> node name; raises GangBindError having undone any
        binding it made when one of them fails."""


class GangBindError(KubernetesBackendError):
    """A gang could not be bound whole; none of its pods stays bound."""


class GangUnplaceable(KubernetesBackendError):
    """No node set can hold the gang now; the message says which resource is short."""


def describe_api_error(exc: Any) -> str:
    """An ApiException in one line: status, reason and the server's message."""
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", "") or ""
    body = getattr(exc, "body", "") or ""
    message = ""
    if body:
        import json

        try:
            message = str(json.loads(body).get("message", ""))[:300]
        except (ValueError, AttributeError):
            message = str(body)[:300]
    text = f"HTTP {status} {reason}".strip()
    return f"{text}: {message}" if message else text
