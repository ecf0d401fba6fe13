"""Parse and validate job manifests (FfDL `manifest.yml` plus Rhizome's fields).

`schema.json` beside this module is the published contract (served at
`/v1/manifest-schema`); a JSON Schema validator does the structural checks, and the few
rules a schema cannot say (learners vs pipeline shape, elastic bounds, memory units) are
checked here. Every error names the field, what was wrong and what is allowed. A valid
document comes back as the typed `Manifest` (types.py).

Every submit runs this, so the common case is read in one pass (issue #18): a plain
document (no anchors, aliases, explicit tags or merge keys) is built straight from the
parser's events with the limits counted on the way (`_load_plain`), and checked by
jsonschema_rs (compiled once, in Rust). Anything else, and every document either finds
wrong, takes the careful path: the event stream scanned for the limits, then loaded, then
every schema error listed by jsonschema, whose messages the errors are worded from.
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
    import jsonschema_rs

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
# The scalars `_load_plain` builds itself, with SafeLoader's own constructors; a scalar
# of any other tag (a timestamp, a merge key `<<`) sends the document the careful way.
_STR_TAG = "tag:yaml.org,2002:str"
_PLAIN_TAGS = frozenset(f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null"))


@cache
def _validator() -> jsonschema.Draft202012Validator:
    # Imported on first use: jsonschema costs a fifth of a second at daemon start-up.
    import jsonschema

    # Building a validator compiles the schema: once per process, not once per submit.
    return jsonschema.Draft202012Validator(schema())


@cache
def _fast_validator() -> jsonschema_rs.Validator:
    """The schema compiled by jsonschema_rs (Rust, draft 2020-12 like the schema): a
    valid manifest's check costs ~0.3 µs where jsonschema's costs ~40 µs (~280 µs for
    examples/mnist's), a seventh of what fastjsonschema's generated code costs, and without
    fastjsonschema's writing the schema's defaults into the document it checks. It only
    says yes or no: a document it refuses is described by jsonschema (`validate`)."""
    import jsonschema_rs

    return jsonschema_rs.validator_for(schema())


def _surely_valid(data: dict[str, Any]) -> bool:
    """jsonschema_rs's yes. Where it says no and jsonschema yes (a NaN, a name that ends
    in a line break, which Python's `$` lets through and Rust's does not), or where it
    cannot read a value (a YAML date, a non-string key), jsonschema decides."""
    try:
        return _fast_validator().is_valid(data)
    except Exception:  # "Unsupported type" (a value JSON has no type for), or any other
        return False


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
    if not _surely_valid(data):
        errors = sorted(
            _validator().iter_errors(data), key=lambda e: (len(e.absolute_path), e.message)
        )
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


def _load_plain(raw: bytes, limits: Limits) -> Any:
    """The document read in one pass over the parser's events, as SafeLoader would build
    it, when it is plain: one document of mappings, sequences and untagged scalars (str,
    int, float, bool, null) with scalar keys, no anchor or alias, within the depth and
    node limits. None otherwise (and for an empty document, or on any error): the
    careful path then reads it, and says what is wrong if anything is.

    Without aliases every node counts once, so a document within `max_nodes` here is
    within it by `_check_shape`'s count too; the depth is checked before a collection
    is opened, so nothing here recurses."""
    loader = _YAML_LOADER(raw)
    try:
        return _build_plain(loader, limits)
    except Exception:  # a YAML error, say: the careful path reports it as it always has
        return None
    finally:
        loader.dispose()


def _build_plain(loader: Any, limits: Limits) -> Any:
    document: Any = None
    # Each open collection: [the collection, the key awaiting its value, a key awaits].
    open_: list[list[Any]] = []
    nodes = documents = 0
    while True:
        event = loader.get_event()
        kind = type(event)
        value: Any
        if kind is yaml.ScalarEvent:
            if event.anchor is not None or event.tag is not None:
                return None
            tag = loader.resolve(yaml.ScalarNode, event.value, event.implicit)
            if tag == _STR_TAG:
                value = event.value
            elif tag in _PLAIN_TAGS:
                node = yaml.ScalarNode(tag, event.value, event.start_mark, event.end_mark)
                value = loader.yaml_constructors[tag](loader, node)
            else:
                return None
        elif kind is yaml.MappingStartEvent or kind is yaml.SequenceStartEvent:
            if event.anchor is not None or event.tag is not None:
                return None
            if len(open_) >= limits.max_depth:
                return None
            value = {} if kind is yaml.MappingStartEvent else []
        elif kind is yaml.MappingEndEvent or kind is yaml.SequenceEndEvent:
            open_.pop()
            continue
        elif kind is yaml.DocumentStartEvent:
            documents += 1
            if documents > 1:
                return None  # yaml.load refuses a second document
            continue
        elif kind is yaml.StreamEndEvent:
            return document
        elif kind is yaml.AliasEvent:
            return None
        else:  # the stream's start, a document's end
            continue
        nodes += 1
        if nodes > limits.max_nodes:
            return None
        if not open_:
            document = value
        else:
            parent = open_[-1]
            if type(parent[0]) is list:
                parent[0].append(value)
            elif parent[2]:
                parent[0][parent[1]] = value  # a repeated key: the last value, as yaml.load
                parent[2] = False
            elif kind is yaml.ScalarEvent:
                parent[1], parent[2] = value, True
            else:
                return None  # a collection as a key (unhashable)
        if kind is not yaml.ScalarEvent:
            open_.append([value, None, False])


def _load_checked(raw: bytes, limits: Limits) -> Any:
    """The careful path: the limits checked on the event stream, then the document
    loaded; a YAML error is a ManifestError saying where."""
    try:
        _check_shape(raw, limits)
        return yaml.load(raw, Loader=_YAML_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ManifestError("", f"the manifest is not valid YAML{where}: {problem}") from None


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
    data = _load_plain(raw, limits)
    if data is None:
        data = _load_checked(raw, limits)
    if data is None:
        raise ManifestError(
            "", "the manifest is empty; it needs at least name and framework.command"
        )
    return validate(data)
