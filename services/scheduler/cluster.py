"""The cluster model: nodes, their free resources, and what is allocated to whom.

Free resources live in numpy arrays indexed by node so that a placement over
10,000 nodes is a handful of vector operations. The local backend fills the model
from a YAML file (``load_cluster_config``) in which one machine may be described as
several virtual nodes; a Kubernetes backend builds ``Node`` objects from its nodes and
calls ``Cluster(nodes)``.

Config format (every key checked; a typo is an error naming the closest key)::

    nodes:
      - name: local-0           # unique
        cpus: 2
        memory_mb: 4096
        gpus: 0                 # whole GPUs
        gpu_type: ""            # required when gpus > 0
        zone: zone-a            # optional, default "default"
        labels: {disk: ssd}     # optional
        count: 1                # optional: expand into name-0..name-(count-1)
        price_per_hour: 0.918   # optional: $ per node-hour (spot), for a job's cost so
                                # far; default 0, "not priced" (no made-up figure)
    scheduler:                  # optional: the scaling policy of elastic jobs
      scaling: elastic-tiresias # (services/scheduler/elasticity; default none)
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from services.scheduler.api import (
    ClusterConfigError,
    JobRequest,
    NodeView,
    OverCommitError,
    UnknownGpuType,
)

_EPS = 1e-9


@dataclass(frozen=True)
class Node:
    name: str
    cpus: float
    memory_mb: float
    gpus: int = 0
    gpu_type: str = ""
    zone: str = "default"
    labels: Mapping[str, str] = field(default_factory=dict)
    price_per_hour: float = 0.0  # $ per node-hour; 0: not priced


@dataclass(frozen=True)
class Allocation:
    """What one job holds: ``counts[node_index]`` learners, each with the job's resources."""

    job: JobRequest
    learner_nodes: tuple[int, ...]

    def counts(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for idx in self.learner_nodes:
            out[idx] = out.get(idx, 0) + 1
        return out


class Cluster:
    """Nodes plus the allocations made on them. Not thread-safe: the scheduler serializes."""

    def __init__(self, nodes: Sequence[Node]) -> None:
        if not nodes:
            raise ClusterConfigError("the cluster has no nodes; describe at least one node")
        names = [n.name for n in nodes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ClusterConfigError(f"duplicate node names: {', '.join(dupes)}")
        self.nodes: list[Node] = list(nodes)
        self.index: dict[str, int] = {n.name: i for i, n in enumerate(nodes)}
        self.gpu_types: list[str] = sorted({n.gpu_type for n in nodes if n.gpus > 0})
        self.zones: list[str] = sorted({n.zone for n in nodes})
        type_ids = {t: i for i, t in enumerate(self.gpu_types)}
        zone_ids = {z: i for i, z in enumerate(self.zones)}
        self.gpu_type_id = np.array(
            [type_ids[n.gpu_type] if n.gpus > 0 else -1 for n in nodes], dtype=np.int64
        )
        self.zone_id = np.array([zone_ids[n.zone] for n in nodes], dtype=np.int64)
        self.gpus_total = np.array([n.gpus for n in nodes], dtype=np.int64)
        self.cpus_total = np.array([n.cpus for n in nodes], dtype=np.float64)
        self.mem_total = np.array([n.memory_mb for n in nodes], dtype=np.float64)
        self.gpus_free = self.gpus_total.copy()
        self.cpus_free = self.cpus_total.copy()
        self.mem_free = self.mem_total.copy()
        self.allocations: dict[str, Allocation] = {}
        # Allocations and releases so far: a scheduling pass that carries on from the
        # last one (GangScheduler._resume) knows by it that nothing was freed since.
        self.changes = 0
        # Node indices a placement should leave out now (a straggler was seen there):
        # `capacity` counts no room on them; allocation itself is not restricted.
        self.avoided: set[int] = set()

    # -- what fits -------------------------------------------------------------------

    def check_gpu_type(self, job: JobRequest) -> None:
        if job.gpus > 0 and job.gpu_type not in self.gpu_types:
            known = ", ".join(self.gpu_types) or "none (this cluster has no GPUs)"
            hint = difflib.get_close_matches(job.gpu_type, self.gpu_types, n=1)
            maybe = f"; did you mean {hint[0]}?" if hint else ""
            raise UnknownGpuType(
                f"job {job.job_id}: unknown GPU type {job.gpu_type!r}; "
                f"the cluster has {known}{maybe}"
            )

    def eligible(self, job: JobRequest) -> np.ndarray:
        """Boolean mask of nodes whose type and labels suit the job (ignoring free space)."""
        mask = np.ones(len(self.nodes), dtype=bool)
        if job.gpus > 0:
            want = self.gpu_types.index(job.gpu_type) if job.gpu_type in self.gpu_types else -2
            mask &= self.gpu_type_id == want
        if job.node_selector:
            sel = dict(job.node_selector)
            mask &= np.array(
                [all(n.labels.get(k) == v for k, v in sel.items()) for n in self.nodes], dtype=bool
            )
        return mask

    def capacity(self, job: JobRequest, *, empty: bool = False) -> np.ndarray:
        """How many of the job's learners each node could take now (or when ``empty``)."""
        gpus = self.gpus_total if empty else self.gpus_free
        cpus = self.cpus_total if empty else self.cpus_free
        mem = self.mem_total if empty else self.mem_free
        cap = np.full(len(self.nodes), job.learners, dtype=np.int64)
        if job.gpus > 0:
            cap = np.minimum(cap, gpus // job.gpus)
        if job.cpus > 0:
            cap = np.minimum(cap, np.floor(cpus / job.cpus + _EPS).astype(np.int64))
        if job.memory_mb > 0:
            cap = np.minimum(cap, np.floor(mem / job.memory_mb + _EPS).astype(np.int64))
        cap[~self.eligible(job)] = 0
        if self.avoided and not empty:
            cap[sorted(self.avoided)] = 0
        return np.maximum(cap, 0)

    def primary(self, job: JobRequest) -> tuple[np.ndarray, np.ndarray, float]:
        """(free, total, need per learner) of the resource that defines 'full' for this job.

        GPUs for GPU jobs; otherwise CPUs, then memory. Packing quality is measured on it.
        """
        if job.gpus > 0:
            return self.gpus_free.astype(np.float64), self.gpus_total.astype(np.float64), job.gpus
        if job.cpus > 0:
            return self.cpus_free, self.cpus_total, job.cpus
        if job.memory_mb > 0:
            return self.mem_free, self.mem_total, job.memory_mb
        ones = np.ones(len(self.nodes))
        return ones, ones, 0.0

    # -- allocate / release --------------------------------------------------------------

    def allocate(self, job: JobRequest, learner_nodes: Sequence[int]) -> Allocation:
        if job.job_id in self.allocations:
            raise OverCommitError(f"job {job.job_id} already holds an allocation")
        if len(learner_nodes) != job.learners:
            raise OverCommitError(
                f"job {job.job_id}: {len(learner_nodes)} learners placed, {job.learners} requested"
            )
        alloc = Allocation(job, tuple(int(i) for i in learner_nodes))
        counts = alloc.counts()
        eligible = self.eligible(job)
        for idx, k in counts.items():
            node = self.nodes[idx]
            if not eligible[idx]:
                raise OverCommitError(f"job {job.job_id}: node {node.name} does not suit it")
            if (
                self.gpus_free[idx] < k * job.gpus
                or self.cpus_free[idx] + _EPS < k * job.cpus
                or self.mem_free[idx] + _EPS < k * job.memory_mb
            ):
                raise OverCommitError(
                    f"job {job.job_id}: {k} learner(s) do not fit on {node.name} "
                    f"(free {self.gpus_free[idx]} GPUs, {self.cpus_free[idx]:g} CPUs, "
                    f"{self.mem_free[idx]:g} MB)"
                )
        for idx, k in counts.items():
            self.gpus_free[idx] -= k * job.gpus
            self.cpus_free[idx] -= k * job.cpus
            self.mem_free[idx] -= k * job.memory_mb
        self.allocations[job.job_id] = alloc
        self.changes += 1
        return alloc

    def release(self, job_id: str) -> Allocation | None:
        alloc = self.allocations.pop(job_id, None)
        if alloc is None:
            return None
        self.changes += 1
        job = alloc.job
        for idx, k in alloc.counts().items():
            self.gpus_free[idx] += k * job.gpus
            self.cpus_free[idx] = min(self.cpus_total[idx], self.cpus_free[idx] + k * job.cpus)
            self.mem_free[idx] = min(self.mem_total[idx], self.mem_free[idx] + k * job.memory_mb)
        return alloc

    # -- views ---------------------------------------------------------------------------

    def node_views(self) -> list[NodeView]:
        return [
            NodeView(
                name=n.name,
                gpu_type=n.gpu_type,
                gpus_total=int(self.gpus_total[i]),
                gpus_free=int(self.gpus_free[i]),
                cpus_total=float(self.cpus_total[i]),
                cpus_free=float(self.cpus_free[i]),
                memory_mb_total=float(self.mem_total[i]),
                memory_mb_free=float(self.mem_free[i]),
                zone=n.zone,
                labels=dict(n.labels),
                price_per_hour=n.price_per_hour,
            )
            for i, n in enumerate(self.nodes)
        ]

    def total_gpus(self, gpu_type: str | None = None) -> int:
        if gpu_type is None:
            return int(self.gpus_total.sum())
        if gpu_type not in self.gpu_types:
            return 0
        return int(self.gpus_total[self.gpu_type_id == self.gpu_types.index(gpu_type)].sum())

    def free_gpus(self, gpu_type: str | None = None) -> int:
        if gpu_type is None:
            return int(self.gpus_free.sum())
        if gpu_type not in self.gpu_types:
            return 0
        return int(self.gpus_free[self.gpu_type_id == self.gpu_types.index(gpu_type)].sum())

    def copy_empty(self) -> Cluster:
        return Cluster(self.nodes)


_NODE_KEYS = {
    "name",
    "cpus",
    "memory_mb",
    "gpus",
    "gpu_type",
    "zone",
    "labels",
    "count",
    "price_per_hour",
}


def _typo(key: str, allowed: Iterable[str]) -> str:
    hint = difflib.get_close_matches(key, list(allowed), n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else ""


def _number(where: str, key: str, value: Any, *, integer: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ClusterConfigError(f"{where}: {key}={value!r} is not a number")
    if not math.isfinite(value) or value < 0:
        raise ClusterConfigError(f"{where}: {key}={value!r}; use a number >= 0")
    if integer and value != int(value):
        raise ClusterConfigError(f"{where}: {key}={value!r}; use a whole number")
    return float(value)


def nodes_from_config(config: Mapping[str, Any], source: str = "cluster config") -> list[Node]:
    """Build nodes from a parsed config mapping; every error names the node and the key."""
    if not isinstance(config, Mapping):
        raise ClusterConfigError(f"{source}: expected a mapping with a 'nodes' list")
    # `scheduler:` (the scaling policy) is read by services.scheduler.elasticity
    extra = set(config) - {"nodes", "scheduler"}
    if extra:
        key = sorted(extra)[0]
        raise ClusterConfigError(
            f"{source}: unknown top-level key {key!r}{_typo(key, ['nodes', 'scheduler'])}"
        )
    raw_nodes = config.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise ClusterConfigError(f"{source}: 'nodes' must be a non-empty list of nodes")
    nodes: list[Node] = []
    for pos, raw in enumerate(raw_nodes):
        where = f"{source}: nodes[{pos}]"
        if not isinstance(raw, Mapping):
            raise ClusterConfigError(f"{where}: expected a mapping, got {raw!r}")
        for key in raw:
            if key not in _NODE_KEYS:
                raise ClusterConfigError(f"{where}: unknown key {key!r}{_typo(key, _NODE_KEYS)}")
        name = raw.get("name")
        if not isinstance(name, str) or not name:
            raise ClusterConfigError(f"{where}: every node needs a non-empty 'name'")
        where = f"{source}: node {name!r}"
        for key in ("cpus", "memory_mb"):
            if key not in raw:
                raise ClusterConfigError(f"{where}: missing {key!r}")
        cpus = _number(where, "cpus", raw["cpus"])
        mem = _number(where, "memory_mb", raw["memory_mb"])
        gpus = int(_number(where, "gpus", raw.get("gpus", 0), integer=True))
        gpu_type = str(raw.get("gpu_type", "") or "")
        if gpus > 0 and not gpu_type:
            raise ClusterConfigError(f"{where}: has {gpus} GPUs but no 'gpu_type'")
        labels = raw.get("labels") or {}
        if not isinstance(labels, Mapping):
            raise ClusterConfigError(f"{where}: 'labels' must be a mapping")
        count = int(_number(where, "count", raw.get("count", 1), integer=True))
        if count < 1:
            raise ClusterConfigError(f"{where}: count must be >= 1")
        zone = str(raw.get("zone", "default"))
        price = _number(where, "price_per_hour", raw.get("price_per_hour", 0))
        names = (
            [name] if count == 1 and "count" not in raw else [f"{name}-{i}" for i in range(count)]
        )
        for node_name in names:
            nodes.append(
                Node(
                    name=node_name,
                    cpus=cpus,
                    memory_mb=mem,
                    gpus=gpus,
                    gpu_type=gpu_type if gpus > 0 else "",
                    zone=zone,
                    labels={str(k): str(v) for k, v in labels.items()},
                    price_per_hour=price,
                )
            )
    return nodes


def load_cluster_config(path: str | Path) -> Cluster:
    """Read a cluster YAML file (format in this module's docstring) into a Cluster."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ClusterConfigError(f"cannot read cluster config {p}: {exc}") from exc
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ClusterConfigError(f"{p}: not valid YAML: {exc}") from exc
    return Cluster(nodes_from_config(config, str(p)))
