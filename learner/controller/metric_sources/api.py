"""What a metric source is, how the manifest names one, and the registry of types.

The manifest's `evaluation_metrics` follows FfDL: one mapping, or a list of them, each
with a `type` (`logger`, `regex_extractor`, `emetrics_file`, `tensorboard`) and an `in`:
a log stream of the learner (`stdout`, `stderr`) or a path relative to the learner's job
directory (`$JOB_STATE_DIR/...` is accepted and means the same). See
docs/logs-and-metrics.md for every field.

A source is driven by the collector: stream-fed sources get the lines the collector read
(`feed`), file sources read their own files (`poll`). Both return `Sample`s and expose a
JSON-able `state()` that the collector commits together with the log offsets once the
TDS has acknowledged the batch, so a restarted collector resumes every source exactly
where the acknowledged data ended.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from contract.logs import COMMAND_STREAMS
from contract.registry import Registry

# A metric source may read one of the command's streams by name.
LOG_STREAMS = COMMAND_STREAMS


class MetricSourceError(ValueError):
    """A bad `evaluation_metrics` entry; the message says which field and how to fix it."""


@dataclass(frozen=True)
class Sample:
    name: str
    value: float
    step: int = 0
    time_us: int | None = None  # None: the collector stamps the time it read it


class MetricSource(abc.ABC):
    type: ClassVar[str]

    def __init__(self, spec: Mapping[str, Any], learner_dir: Path, source_id: str) -> None:
        self.spec = spec
        self.learner_dir = Path(learner_dir)
        self.source_id = source_id
        self.stream: str | None = None  # set when the source reads a log stream

    def feed(self, lines: list[str], final: bool) -> list[Sample]:
        """Lines the collector just read from `self.stream` (final: the learner is done)."""
        return []

    def poll(self, final: bool, max_records: int) -> list[Sample]:
        """Read new data from the source's own files."""
        return []

    @abc.abstractmethod
    def state(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def restore(self, state: Mapping[str, Any]) -> None: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    # -- helpers for subclasses -------------------------------------------------------
    def resolve(self, where: str) -> Path:
        """A path of the manifest, relative to the learner's job directory."""
        for var in ("${JOB_STATE_DIR}", "$JOB_STATE_DIR"):
            if where.startswith(var):
                where = where[len(var) :].lstrip("/") or "."
        path = Path(os.path.expanduser(where))
        return path if path.is_absolute() else self.learner_dir / path


SourceFactory = Callable[[Mapping[str, Any], Path, str], MetricSource]


def _load_builtin() -> None:
    from learner.controller.metric_sources import (  # noqa: F401 - registers
        emetrics_file,
        logger,
        regex_extractor,
        tensorboard,
    )


# The built-in types register themselves when their modules are imported, on first use.
SOURCES: Registry[SourceFactory] = Registry(
    "metric source type", error=MetricSourceError, load=_load_builtin
)


def register_source(name: str, factory: SourceFactory | str) -> None:
    SOURCES.register(name, factory)


def create_sources(spec: Any, learner_dir: Path) -> list[MetricSource]:
    """Sources for a manifest's `evaluation_metrics` (None, one mapping, or a list).

    Each gets an id, its type name — `regex_extractor`, then `regex_extractor.1` for a
    second of the same type — which keys its seq numbers and document ids.
    """
    if spec is None:
        return []
    specs = [spec] if isinstance(spec, Mapping) else spec
    if not isinstance(specs, list):
        raise MetricSourceError(
            f"evaluation_metrics must be a mapping or a list of mappings, not {type(spec).__name__}"
        )
    out: list[MetricSource] = []
    counts: dict[str, int] = {}
    for i, one in enumerate(specs):
        if not isinstance(one, Mapping):
            raise MetricSourceError(f"evaluation_metrics[{i}] must be a mapping with a 'type'")
        kind = one.get("type")
        if not isinstance(kind, str) or kind not in SOURCES:
            raise MetricSourceError(
                f"evaluation_metrics[{i}].type is {kind!r}; use one of {SOURCES.names()}"
            )
        n = counts.get(kind, 0)
        counts[kind] = n + 1
        source_id = kind if n == 0 else f"{kind}.{n}"
        try:
            out.append(SOURCES.get(kind)(one, Path(learner_dir), source_id))
        except MetricSourceError as exc:
            raise MetricSourceError(f"evaluation_metrics[{i}] ({kind}): {exc}") from exc
    return out
