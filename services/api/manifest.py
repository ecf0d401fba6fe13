"""Parse and validate job manifests (FfDL `manifest.yml` plus Rhizome's fields).

The JSON Schema beside this module is the published contract (served at
`/v1/manifest-schema`); jsonschema does the structural checks, and the few rules a schema
cannot say (learners vs pipeline shape, elastic bounds, memory units) are checked here.
Every error names the field, what was wrong and what is allowed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    import jsonschema

MAX_MANIFEST_BYTES = 256 * 1024
_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?[Bb]?|[KMGT]b|[KMGT]B)?\s*$")
_UNIT_MB = {"K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0 * 1024}
MAX_MEMORY_MB = 4 * 1024 * 1024
# libyaml's safe loader when PyYAML was built with it: same rules, several times faster.
_YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ManifestError(ValueError):
    """A manifest that cannot be accepted; `field` is the dotted path of the culprit."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}" if field else problem)
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class Manifest:
    """A validated manifest. Readers take fields through these properties, whose defaults
    are the schema's (`schema_default`), never re-typed where a field is read."""

    data: dict[str, Any]

    def _get(self, field: str) -> Any:
        return self.data[field] if field in self.data else schema_default(field)

    @property
    def name(self) -> str:
        return str(self.data["name"])

    @property
    def description(self) -> str:
        return str(self.data.get("description", ""))

    @property
    def learners(self) -> int:
        return int(self._get("learners"))

    @property
    def command(self) -> str:
        return str(self.data["framework"]["command"])

    @property
    def priority(self) -> int:
        return int(self._get("priority"))

    @property
    def max_learner_restarts(self) -> int:
        return int(self._get("max_learner_restarts"))

    @property
    def pipeline_stages(self) -> int:
        """Stages per pipeline; a job without `pipeline` is one stage."""
        pipeline = self.data.get("pipeline")
        return int(pipeline["stages"]) if pipeline else 1

    @property
    def pipelines(self) -> int:
        """Data-parallel pipelines; a job without `pipeline` is one."""
        pipeline = self.data.get("pipeline")
        if not pipeline:
            return 1
        return int(pipeline.get("pipelines", schema_default("pipeline", "pipelines")))

    def resources(self) -> dict[str, Any]:
        return {
            "learners": self.learners,
            "gpus": float(self._get("gpus")),
            "cpus": float(self._get("cpus")),
            "memory_mb": parse_memory_mb(self._get("memory")),
            "gpu_type": str(self.data.get("gpu_type", "")),
        }


@cache
def schema() -> dict[str, Any]:
    text = resources.files("services.api").joinpath("manifest.schema.json").read_text()
    loaded: dict[str, Any] = json.loads(text)
    return loaded


@cache
def schema_default(*path: str) -> Any:
    """The default the schema gives a field, by its path: `schema_default("priority")`,
    `schema_default("pipeline", "pipelines")`. Defaults are written once, in the schema;
    a field without one is a KeyError naming it."""
    node = schema()
    for part in path:
        node = node["properties"][part]
    if "default" not in node:
        raise KeyError(f"manifest field {'.'.join(path)} has no default in the schema")
    return node["default"]


@cache
def _validator() -> jsonschema.Draft202012Validator:
    # Imported on first use: jsonschema costs a fifth of a second at daemon start-up.
    import jsonschema

    # Building a validator compiles the schema: once per process, not once per submit.
    return jsonschema.Draft202012Validator(schema())


def parse_memory_mb(value: Any, field: str = "memory") -> float:
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


def _path(error: jsonschema.ValidationError) -> str:
    parts = [str(p) for p in error.absolute_path]
    return ".".join(parts)


def _describe(error: jsonschema.ValidationError) -> ManifestError:
    if error.validator in ("oneOf", "anyOf") and error.context:
        # "is not valid under any of the given schemas" helps nobody: report the
        # alternative that came closest, e.g. the bad `type` of a metric source.
        # The deepest complaint is about the branch the user meant (a list is checked
        # against the list form, not told it should be an object).
        deepest = max(error.context, key=lambda e: len(e.absolute_path))
        return _describe(deepest)
    field = _path(error)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = (
            sorted(set(error.instance) - set(allowed)) if isinstance(error.instance, dict) else []
        )
        where = f"{field}." if field else ""
        return ManifestError(
            f"{where}{extra[0]}" if extra else field,
            f"unknown field; allowed here: {', '.join(allowed)}",
        )
    if error.validator == "required":
        missing = re.findall(r"'([^']+)' is a required property", error.message)
        name = missing[0] if missing else "?"
        return ManifestError(f"{field}.{name}" if field else name, "is required")
    if error.validator == "enum":
        opts = ", ".join(str(o) for o in error.validator_value)
        return ManifestError(field, f"{error.instance!r} is not allowed; choose one of: {opts}")
    if error.validator == "type":
        return ManifestError(field, f"{error.instance!r} should be of type {error.validator_value}")
    if error.validator == "pattern":
        hint = error.schema.get("description", f"must match {error.validator_value}")
        return ManifestError(field, f"{error.instance!r} is not valid: {hint}")
    return ManifestError(field, error.message)


def validate(data: Any) -> Manifest:
    if not isinstance(data, dict):
        raise ManifestError(
            "", "the manifest must be a YAML mapping of fields (name, framework, ...)"
        )
    errors = sorted(_validator().iter_errors(data), key=lambda e: (len(e.absolute_path), e.message))
    if errors:
        raise _describe(errors[0])
    manifest = Manifest(data)
    resources_ = manifest.resources()  # checks the memory size
    pipeline = data.get("pipeline")
    if pipeline:
        shape = manifest.pipeline_stages * manifest.pipelines
        if "learners" in data and manifest.learners != shape:
            raise ManifestError(
                "learners",
                f"{manifest.learners} does not match the pipeline shape "
                f"(stages × pipelines = {shape}); set learners to {shape} or leave it out",
            )
        data["learners"] = shape
    elastic = data.get("elastic")
    if elastic:
        if elastic["min"] > elastic["max"]:
            raise ManifestError(
                "elastic.min", f"{elastic['min']} is larger than max {elastic['max']}"
            )
        if not elastic["min"] <= manifest.learners <= elastic["max"]:
            raise ManifestError(
                "learners",
                f"{manifest.learners} is outside elastic bounds [{elastic['min']}, {elastic['max']}]",
            )
    if (
        resources_["gpus"]
        and resources_["gpus"] != int(resources_["gpus"])
        and resources_["gpus"] > 1
    ):
        raise ManifestError("gpus", "fractional GPUs are only allowed below 1 per learner")
    return manifest


def parse_manifest(text: str | bytes) -> Manifest:
    """YAML text -> validated Manifest, or ManifestError naming what is wrong."""
    raw = text.encode() if isinstance(text, str) else text
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError("", f"the manifest is {len(raw)} bytes; at most {MAX_MANIFEST_BYTES}")
    try:
        data = yaml.load(raw, Loader=_YAML_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ManifestError("", f"the manifest is not valid YAML{where}: {problem}") from None
    if data is None:
        raise ManifestError(
            "", "the manifest is empty; it needs at least name and framework.command"
        )
    return validate(data)
