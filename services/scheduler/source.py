"""Where the scheduler service's nodes come from: a cluster source.

The scheduler service (queue, quotas, `rhizome show`'s reasons, placement) and whatever
binds learners to machines must see one node list. A cluster source is that list's one
owner: the `config` source reads `--cluster-config` once (the local and docker
backends, whose "cluster" is a description of the machines); the `kubernetes` source
(services/backends/kubernetes/cluster_source.py) follows the cluster's Nodes through a
watch, the same model our pod binder places gangs on, and reports every change.

A source is chosen by the learner backend's name: a backend that owns its cluster
registers a source under its own name in CLUSTER_SOURCES; every other backend gets
`config`. The scheduling loop asks `version()` on each pass and rebuilds its model from
`nodes()` when it moved (services/scheduler/hosting.py).
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from pathlib import Path

from contract.registry import Registry
from services.config import PlatformConfig
from services.scheduler.api import ClusterConfigError
from services.scheduler.cluster import Node, load_cluster_config

DEFAULT_CLUSTER = Path(__file__).resolve().parents[2] / "deploy" / "cluster-local.yaml"


class ClusterSource(abc.ABC):
    """The nodes the scheduler may place learners on, and when they change."""

    @abc.abstractmethod
    def start(self, on_change: Callable[[], None]) -> None:
        """Begin following the cluster; returns once the first full node list is known
        (or raises ClusterConfigError saying why it cannot be). `on_change` is called,
        from any thread, after each change of `nodes()`."""

    @abc.abstractmethod
    def nodes(self) -> list[Node]:
        """The schedulable nodes now, sorted by name (may be empty while a cluster has
        none: every node cordoned, NotReady or gone)."""

    @abc.abstractmethod
    def version(self) -> int:
        """A number that moves whenever `nodes()` changes."""

    @abc.abstractmethod
    def describe(self) -> str:
        """Where the nodes come from, for logs and errors."""

    def close(self) -> None:  # noqa: B027 (optional: a file source holds nothing)
        """Stop following the cluster."""


class ConfigFileSource(ClusterSource):
    """The nodes of a cluster config file (`--cluster-config`), read once."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._nodes: list[Node] = []

    def start(self, on_change: Callable[[], None]) -> None:
        self._nodes = sorted(load_cluster_config(self.path).nodes, key=lambda n: n.name)

    def nodes(self) -> list[Node]:
        return list(self._nodes)

    def version(self) -> int:
        return 0

    def describe(self) -> str:
        return f"cluster config {self.path}"


class StaticSource(ClusterSource):
    """Nodes set by the caller (tests, the simulator): `set_nodes` is a change."""

    def __init__(self, nodes: list[Node]) -> None:
        self._nodes = sorted(nodes, key=lambda n: n.name)
        self._version = 0
        self._on_change: Callable[[], None] = lambda: None
        self._lock = threading.Lock()

    def start(self, on_change: Callable[[], None]) -> None:
        self._on_change = on_change

    def set_nodes(self, nodes: list[Node]) -> None:
        with self._lock:
            self._nodes = sorted(nodes, key=lambda n: n.name)
            self._version += 1
        self._on_change()

    def nodes(self) -> list[Node]:
        with self._lock:
            return list(self._nodes)

    def version(self) -> int:
        with self._lock:
            return self._version

    def describe(self) -> str:
        return "nodes set by the caller"


def config_file_source(config: PlatformConfig) -> ConfigFileSource:
    return ConfigFileSource(config.cluster_config or DEFAULT_CLUSTER)


ClusterSourceFactory = Callable[[PlatformConfig], ClusterSource]
CLUSTER_SOURCES: Registry[ClusterSourceFactory] = Registry(
    "cluster source", error=ClusterConfigError
)
CLUSTER_SOURCES.register("config", "services.scheduler.source:config_file_source")
CLUSTER_SOURCES.register("kubernetes", "services.backends.kubernetes.cluster_source:node_source")


def cluster_source(config: PlatformConfig) -> ClusterSource:
    """The backend's own source when it registered one (its name), else `config`. A
    cluster config given to a backend that owns its nodes would be silently ignored, so
    it is refused."""
    if config.backend in CLUSTER_SOURCES.names():
        if config.cluster_config:
            raise ClusterConfigError(
                f"--cluster-config ({config.cluster_config}) describes the machines of the "
                f"local and docker backends; with --backend {config.backend} the scheduler "
                "reads the cluster's own nodes: drop --cluster-config (RHIZOME_CLUSTER_CONFIG)"
            )
        return CLUSTER_SOURCES.get(config.backend)(config)
    return CLUSTER_SOURCES.get("config")(config)
