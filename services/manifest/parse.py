"""Parse and validate job manifests (FfDL `manifest.yml` plus Rhizome's fields).

`schema.json` beside this module is the published contract (served at
`/v1/manifest-schema`); jsonschema does the structural checks, and the few rules a schema
cannot say (learners vs pipeline shape, elastic bounds, memory units) are checked here.
Every error names the field, what was wrong and what is allowed. A valid document comes
back as the typed `Manifest` (types.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import yaml

from services.manifest.schema import schema
from services.manifest.types import Manifest, ManifestError

if TYPE_CHECKING:
    import jsonschema

MAX_MANIFEST_BYTES = 256 * 1024


@dataclass(frozen=True)
class Limits:
    """What a manifest may cost to read, checked before anything is built from it.

    A few hundred bytes of YAML aliases can expand to millions of nodes ("billion
    laughs"), and a deeply nested document exhausts the recursion of the loader and the
    schema validator; both would take the daemon down. The document's event stream is
    scanned first (cheap: aliases are not expanded there), so no limit can be overrun by
    the check itself. docs/manifest.md lists the defaults.
    """

    max_bytes: int = MAX_MANIFEST_BYTES
    max_depth: int = 32  # nested mappings/sequences; real manifests use 4
    max_aliases: int = 64  # `*name` references
    max_nodes: int = 20_000  # scalars + collections, with every alias expanded


DEFAULT_LIMITS = Limits()
# libyaml's safe loader when PyYAML was built with it: same rules, several times faster.
_YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@cache
def _validator() -> jsonschema.Draft202012Validator:
    # Imported on first use: jsonschema costs a fifth of a second at daemon start-up.
    import jsonschema

    # Building a validator compiles the schema: once per process, not once per submit.
    return jsonschema.Draft202012Validator(schema())


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


_MAX_LEARNERS = 1024  # the schema's `learners` maximum


def validate(data: Any) -> Manifest:
    if not isinstance(data, dict):
        raise ManifestError(
            "", "the manifest must be a YAML mapping of fields (name, framework, ...)"
        )
    errors = sorted(_validator().iter_errors(data), key=lambda e: (len(e.absolute_path), e.message))
    if errors:
        raise _describe(errors[0])
    pipeline = data.get("pipeline")
    if pipeline:
        shape = int(pipeline["stages"]) * int(pipeline.get("pipelines", 1))
        if "learners" in data and int(data["learners"]) != shape:
            raise ManifestError(
                "learners",
                f"{data['learners']} does not match the pipeline shape "
                f"(stages × pipelines = {shape}); set learners to {shape} or leave it out",
            )
        pipelines = int(pipeline.get("pipelines", 1))
        if "max_pipelines" in pipeline and int(pipeline["max_pipelines"]) < pipelines:
            raise ManifestError(
                "pipeline.max_pipelines",
                f"{pipeline['max_pipelines']} is below pipeline.pipelines ({pipelines}): it is "
                "the most pipelines the job may grow to from its standbys; set it to at "
                f"least {pipelines}, or leave it out for no growth",
            )
        standbys = int(pipeline.get("standbys", 0))
        if shape + standbys > _MAX_LEARNERS:
            raise ManifestError(
                "pipeline",
                f"stages × pipelines + standbys = {shape + standbys} learners; a job may have "
                f"at most {_MAX_LEARNERS}",
            )
        command = str((data.get("framework") or {}).get("command", ""))
        if "learner.runtime.launch" in command:
            raise ManifestError(
                "framework.command",
                "a pipeline job's learners are its workers (the platform starts one runtime "
                "worker per learner): make the command the training script itself, e.g. "
                "`python train.py`, without `python -m learner.runtime.launch`",
            )
        data["learners"] = shape
    manifest = Manifest.from_document(data)  # also checks the memory size
    if manifest.elastic:
        lo, hi = manifest.elastic.min, manifest.elastic.max
        if lo > hi:
            raise ManifestError("elastic.min", f"{lo} is larger than max {hi}")
        if not lo <= manifest.learners <= hi:
            raise ManifestError(
                "learners", f"{manifest.learners} is outside elastic bounds [{lo}, {hi}]"
            )
    gpus = manifest.resources.gpus
    if gpus and gpus != int(gpus) and gpus > 1:
        raise ManifestError("gpus", "fractional GPUs are only allowed below 1 per learner")
    return manifest


def _check_shape(raw: bytes, limits: Limits) -> None:
    """Refuse documents that are too deep or expand too far, before loading them."""
    depth = aliases = 0
    sizes: dict[str, int] = {}  # anchor -> expanded node count
    stack: list[tuple[str | None, int]] = [(None, 0)]  # (anchor, nodes so far) per level
    for event in yaml.parse(raw, Loader=_YAML_LOADER):
        if isinstance(event, yaml.MappingStartEvent | yaml.SequenceStartEvent):
            depth += 1
            if depth > limits.max_depth:
                line = event.start_mark.line + 1 if event.start_mark else "?"
                raise ManifestError(
                    "",
                    f"the manifest nests deeper than {limits.max_depth} levels (line {line}); "
                    "a manifest needs a handful",
                )
            stack.append((event.anchor, 0))
            continue
        if isinstance(event, yaml.MappingEndEvent | yaml.SequenceEndEvent):
            depth -= 1
            anchor, n = stack.pop()
            n += 1
            if anchor:
                sizes[anchor] = n
        elif isinstance(event, yaml.AliasEvent):
            aliases += 1
            if aliases > limits.max_aliases:
                raise ManifestError(
                    "", f"the manifest uses more than {limits.max_aliases} YAML aliases (*name)"
                )
            n = sizes.get(event.anchor or "", 1)
        elif isinstance(event, yaml.ScalarEvent):
            n = 1
            if event.anchor:
                sizes[event.anchor] = 1
        else:
            continue
        parent_anchor, total = stack[-1]
        total += n
        stack[-1] = (parent_anchor, total)
        if total > limits.max_nodes:
            raise ManifestError(
                "",
                f"the manifest expands to more than {limits.max_nodes} values (YAML aliases "
                "count once per use); write the values out or use fewer aliases",
            )


def parse_manifest(text: str | bytes, limits: Limits = DEFAULT_LIMITS) -> Manifest:
    """YAML text -> validated Manifest, or ManifestError naming what is wrong."""
    raw = text.encode() if isinstance(text, str) else text
    if len(raw) > limits.max_bytes:
        raise ManifestError("", f"the manifest is {len(raw)} bytes; at most {limits.max_bytes}")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(
            "",
            f"the manifest is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
            f"{exc.start}); save it as UTF-8",
        ) from None
    try:
        _check_shape(raw, limits)
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
