"""The scheduler service's nodes on Kubernetes: the cluster's Nodes, watched.

The daemon's scheduler service (queue, quotas, `rhizome show`'s reasons) and our pod
binder (scheduler.py) read the same model: `node_from_object` over a list+watch of the
Nodes (allocatable CPU, memory and `nvidia.com/gpu`, zone, spot, GPU type; cordoned,
NotReady and tainted nodes left out). A change of the schedulable nodes — not every
status heartbeat a kubelet sends — bumps the version the scheduling loop follows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kubernetes import client as k8s

from services.backends.kubernetes.api import KubeSettings
from services.backends.kubernetes.client import Calls, api_client
from services.backends.kubernetes.scheduler import NodeWatch
from services.config import PlatformConfig
from services.scheduler.api import ClusterConfigError
from services.scheduler.cluster import Node
from services.scheduler.source import ClusterSource

# How long the daemon waits for the first list of Nodes before it refuses to start.
FIRST_LIST_TIMEOUT_S = 30.0


class _NotifyingNodeWatch(NodeWatch):
    """NodeWatch that tells the source when the schedulable nodes changed."""

    def __init__(self, core: k8s.CoreV1Api, calls: Calls, changed: Callable[[], None]) -> None:
        super().__init__(core, calls)
        self._notify = changed

    def replace_all(self, items: list[dict[str, Any]]) -> None:
        super().replace_all(items)
        self._notify()

    def apply_object(self, kind: str, obj: dict[str, Any]) -> None:
        super().apply_object(kind, obj)
        self._notify()


class KubernetesNodeSource(ClusterSource):
    def __init__(self, settings: KubeSettings, api: k8s.ApiClient | None = None) -> None:
        self.settings = settings
        self.api = api or api_client(settings)
        self._watch = _NotifyingNodeWatch(
            k8s.CoreV1Api(self.api), Calls(settings), self._maybe_changed
        )
        self._lock = threading.Lock()
        self._nodes: list[Node] = []
        self._version = 0
        self._on_change: Callable[[], None] = lambda: None

    def _maybe_changed(self) -> None:
        nodes = self._watch.nodes()
        with self._lock:
            if nodes == self._nodes:
                return  # a heartbeat or a label we do not read: the model stays
            self._nodes = nodes
            self._version += 1
        self._on_change()

    def start(self, on_change: Callable[[], None]) -> None:
        self._on_change = on_change
        self._watch.start()
        if not self._watch.synced.wait(FIRST_LIST_TIMEOUT_S):
            self._watch.stop()
            raise ClusterConfigError(
                f"{self.describe()}: could not list the cluster's Nodes within "
                f"{FIRST_LIST_TIMEOUT_S:g}s; check that the API server runs, that "
                "RHIZOME_K8S_CONTEXT or RHIZOME_K8S_SERVER points at it, and that the "
                "daemon's account may list and watch nodes"
            )

    def nodes(self) -> list[Node]:
        with self._lock:
            return list(self._nodes)

    def version(self) -> int:
        with self._lock:
            return self._version

    def describe(self) -> str:
        where = self.settings.server or self.settings.context or "in-cluster"
        return f"the Kubernetes Nodes of {where}"

    def close(self) -> None:
        self._watch.stop()


def node_source(config: PlatformConfig) -> KubernetesNodeSource:
    """The `kubernetes` cluster source: settings from RHIZOME_K8S_*, as the backend's."""
    return KubernetesNodeSource(KubeSettings.from_environ())
