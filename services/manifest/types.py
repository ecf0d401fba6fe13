"""The typed job manifest: what every service reads once the API has accepted a job.

The API validates the YAML document against `schema.json` (see `parse.py`) and stores the
document with the job; services turn a stored document back into a `Manifest` with
`Manifest.from_document` instead of reading dictionary keys by hand. Defaults are not
written here: each comes from the schema's `default` keyword (`schema_default`), so the schema
is the one place that says what an omitted field means.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from contract import runtime_metrics
from services.manifest.schema import schema

_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?[Bb]?|[KMGT]b|[KMGT]B)?\s*$")
_UNIT_MB = {"K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0 * 1024}
MAX_MEMORY_MB = 4 * 1024 * 1024
REDACTED = "***"
# What a job name may hold where it must be safe (list filters, labels, file names).
_UNSAFE_NAME_RUN = re.compile(r"[^A-Za-z0-9._-]+")


def safe_name(display_name: str) -> str:
    """The job name where only letters, digits, '.', '_' and '-' will do, derived from
    the name as written: FfDL accepted any text ("pytorch ddl"), so a published FfDL
    manifest keeps its name for display and gets `pytorch-ddl` where a safe one is needed.
    A name that is already safe comes back unchanged."""
    derived = _UNSAFE_NAME_RUN.sub("-", display_name).strip("-._")
    if not derived:
        raise ManifestError(
            "name", f"{display_name!r} has no letter or digit to name the job by; add one"
        )
    return derived


class ManifestError(ValueError):
    """A manifest that cannot be accepted; `field` is the dotted path of the culprit."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}" if field else problem)
        self.field = field
        self.problem = problem


@cache
def schema_default(*path: str) -> Any:
    """The default the schema gives a field, by its path: `schema_default("priority")`,
    `schema_default("pipeline", "pipelines")`. Defaults are written once, in the schema;
    a field without one is a KeyError naming it."""
    node: Mapping[str, Any] = schema()
    for part in path:
        node = node["properties"][part]
    if "default" not in node:
        raise KeyError(f"manifest field {'.'.join(path)} has no default in the schema")
    return node["default"]


def parse_memory_mb(value: Any, field: str = "memory") -> float:
    """A memory size (a number of MB, or e.g. 512MiB, 1Gb, 2GB) in MB."""
    if isinstance(value, bool):
        raise ManifestError(field, "expected a number of MB or a size such as 512MiB or 2Gb")
    if isinstance(value, int | float):
        mb = float(value)
    else:
        match = _MEMORY_RE.match(str(value))
        if not match:
            raise ManifestError(
                field, f"{value!r} is not a size; use a number of MB or e.g. 512MiB, 1Gb, 2GB"
            )
        mb = float(match.group(1)) * _UNIT_MB[(match.group(2) or "M")[0].upper()]
    if mb <= 0 or mb > MAX_MEMORY_MB:
        raise ManifestError(field, f"{value!r} is out of range; allowed: more than 0 up to 4 TiB")
    return mb


@dataclass(frozen=True)
class Framework:
    name: str
    version: str
    command: str  # the shell command each learner runs in its job directory
    image: str = ""  # the docker backend's learner image; empty: the platform's default


@dataclass(frozen=True)
class Pipeline:
    """`pipeline:` — a Bamboo pipeline-parallel job: stages × pipelines workers."""

    stages: int
    pipelines: int
    redundancy: str  # none | lazy-frc-lazy-brc | eager-frc-lazy-brc | eager-frc-eager-brc
    microbatches: int | None  # None: the runtime's own default
    standbys: int  # learners beyond the workers (ranks P × D ...) that wait for a lost slot
    # the most pipelines P queued standbys may grow the job to (learner/runtime/
    # reconfigure.py); equal to `pipelines` (the default): no growth
    max_pipelines: int = 0
    # each worker's runtime metrics: one line per this many steps (their means)
    metrics_every: int = 1

    def __post_init__(self) -> None:
        if self.max_pipelines == 0:
            object.__setattr__(self, "max_pipelines", self.pipelines)

    @property
    def workers(self) -> int:
        return self.stages * self.pipelines

    @property
    def learners(self) -> int:
        """Every learner deployed: the workers, then the standbys."""
        return self.workers + self.standbys


@dataclass(frozen=True)
class Checkpoint:
    """`checkpoint:` — how the learner's checkpoint policy saves."""

    policy: str  # adaptive | fixed | none
    interval_s: float | None  # fixed: the period; adaptive: the script's own period, if any
    grace_s: float | None  # SIGTERM -> SIGKILL grace on this job's nodes; None: the platform's
    keep: int  # committed periodic checkpoints kept besides the newest


@dataclass(frozen=True)
class Elastic:
    min: int
    max: int


@dataclass(frozen=True)
class DataStore:
    id: str
    type: str  # local | mount_volume | s3_datastore | mount_cos
    training_data: str  # the container (bucket or folder) of the training data
    training_results: str
    # Credentials among them: never logged, never returned by the API.
    connection: Mapping[str, str] = field(repr=False)


@dataclass(frozen=True)
class Resources:
    """What one learner asks the scheduler for, and how many learners."""

    learners: int
    gpus: float
    cpus: float
    memory_mb: float
    gpu_type: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "learners": self.learners,
            "gpus": self.gpus,
            "cpus": self.cpus,
            "memory_mb": self.memory_mb,
            "gpu_type": self.gpu_type,
        }


@dataclass(frozen=True)
class Manifest:
    """A validated manifest with every default applied. `document` is the stored form."""

    document: Mapping[str, Any] = field(repr=False)
    name: str  # safe_name(display_name): what the job record and list filters use
    description: str
    version: str
    resources: Resources
    priority: int
    max_learner_restarts: int
    max_preemptions: int  # restarts after preemptions, counted apart from failures
    env: Mapping[str, str]
    data_stores: tuple[DataStore, ...]
    framework: Framework
    evaluation_metrics: Any  # FfDL's form, read by learner/controller/metric_sources
    pipeline: Pipeline | None
    checkpoint: Checkpoint
    elastic: Elastic | None
    instance_type: str
    zones: tuple[str, ...]
    estimate: Mapping[str, Any]  # read by `rhizome estimate` alone
    display_name: str = ""  # the name as written in the manifest (may hold spaces)

    @property
    def learners(self) -> int:
        return self.resources.learners

    @property
    def metric_sources(self) -> list[Any] | None:
        """What the learners' collectors read metrics with: `evaluation_metrics` (None, one
        mapping or a list), and for a pipeline job the runtime's per-step metrics last
        (contract/runtime_metrics.py), so the user's sources keep their ids. Every backend
        passes this, never `evaluation_metrics` alone: a source's id is its position, and
        the collectors on both sides of a container must agree on it."""
        sources = self.evaluation_metrics
        own = (
            [] if sources is None else [sources] if isinstance(sources, Mapping) else list(sources)
        )
        if self.pipeline is not None:
            own.append(dict(runtime_metrics.SOURCE))
        return own or None

    def redacted(self) -> dict[str, Any]:
        """The document as the API shows it: every data-store connection value (keys,
        passwords, tokens) replaced by `***`. Only the learner's secrets file holds them."""
        doc = dict(self.document)
        if doc.get("data_stores"):
            doc["data_stores"] = [
                {**ds, "connection": dict.fromkeys(ds.get("connection") or {}, REDACTED)}
                if ds.get("connection")
                else dict(ds)
                for ds in doc["data_stores"]
            ]
        return doc

    @property
    def command(self) -> str:
        return self.framework.command

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> Manifest:
        """The typed form of a document the schema accepted (a stored job's manifest).

        No schema check here: the API validated the document before storing it, and
        this runs on every read of a job.
        """
        fw = doc["framework"]
        pipe = doc.get("pipeline")
        pipeline = None
        if pipe:
            pipeline = Pipeline(
                stages=int(pipe["stages"]),
                pipelines=int(pipe.get("pipelines", schema_default("pipeline", "pipelines"))),
                redundancy=str(pipe.get("redundancy", schema_default("pipeline", "redundancy"))),
                microbatches=int(pipe["microbatches"]) if "microbatches" in pipe else None,
                standbys=int(pipe.get("standbys", schema_default("pipeline", "standbys"))),
                max_pipelines=int(pipe.get("max_pipelines") or 0),
                metrics_every=int(
                    pipe.get("metrics_every", schema_default("pipeline", "metrics_every"))
                ),
            )
        learners = (
            pipeline.learners if pipeline else int(doc.get("learners", schema_default("learners")))
        )
        ck = doc.get("checkpoint") or {}
        el = doc.get("elastic")
        return cls(
            document=doc,
            name=safe_name(str(doc["name"])),
            display_name=str(doc["name"]),
            description=str(doc.get("description", "")),
            version=str(doc.get("version", "")),
            resources=Resources(
                learners=learners,
                gpus=float(doc.get("gpus", schema_default("gpus"))),
                cpus=float(doc.get("cpus", schema_default("cpus"))),
                memory_mb=parse_memory_mb(doc.get("memory", schema_default("memory"))),
                gpu_type=str(doc.get("gpu_type", "")),
            ),
            priority=int(doc.get("priority", schema_default("priority"))),
            max_learner_restarts=int(
                doc.get("max_learner_restarts", schema_default("max_learner_restarts"))
            ),
            max_preemptions=int(doc.get("max_preemptions", schema_default("max_preemptions"))),
            env={str(k): str(v) for k, v in (doc.get("env") or {}).items()},
            data_stores=tuple(
                DataStore(
                    id=str(ds["id"]),
                    type=str(ds["type"]),
                    training_data=str((ds.get("training_data") or {}).get("container", "")),
                    training_results=str((ds.get("training_results") or {}).get("container", "")),
                    connection={str(k): str(v) for k, v in (ds.get("connection") or {}).items()},
                )
                for ds in doc.get("data_stores") or []
            ),
            framework=Framework(
                name=str(fw.get("name", schema_default("framework", "name"))),
                version=str(fw.get("version", "")),
                command=str(fw["command"]),
                image=str(fw.get("image", "")),
            ),
            evaluation_metrics=doc.get("evaluation_metrics"),
            pipeline=pipeline,
            checkpoint=Checkpoint(
                policy=str(ck.get("policy", schema_default("checkpoint", "policy"))),
                interval_s=float(ck["interval_s"]) if "interval_s" in ck else None,
                grace_s=float(ck["grace_s"]) if "grace_s" in ck else None,
                keep=int(ck.get("keep", schema_default("checkpoint", "keep"))),
            ),
            elastic=Elastic(int(el["min"]), int(el["max"])) if el else None,
            instance_type=str(doc.get("instance_type", "")),
            zones=tuple(str(z) for z in doc.get("zones") or ()),
            estimate=dict(doc.get("estimate") or {}),
        )
