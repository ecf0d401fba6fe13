"""The submit-time shortcuts of services/manifest/parse.py decide nothing differently from
the careful path they stand in for (issue #18):

- `_load_plain` (one pass over the parser's events) builds exactly what `yaml.load` builds
  for a plain document, and leaves every other document to the careful path;
- jsonschema_rs's yes (`_surely_valid`) is never given to a document that jsonschema
  refuses, so no manifest is accepted that was refused before.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.manifest import ManifestError, parse_manifest
from services.manifest.parse import (
    _YAML_LOADER,
    DEFAULT_LIMITS,
    Limits,
    _load_plain,
    _surely_valid,
    _validator,
)

ROOT = Path(__file__).resolve().parents[3]
CORPUS = sorted(
    [
        *ROOT.glob("examples/*/manifest*.yml"),
        *ROOT.glob("examples/*/*.yaml"),
        *ROOT.glob("tests/data/ffdl_examples/*"),
    ]
)


def same(a: Any, b: Any) -> bool:
    """Equal, with the same types all the way down (1 == True == 1.0 is not enough)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def loaded(text: str | bytes) -> Any:
    return yaml.load(text.encode() if isinstance(text, str) else text, Loader=_YAML_LOADER)


def test_the_corpus_is_there() -> None:
    assert len(CORPUS) >= 20


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_known_manifest_loads_in_one_pass_as_yaml_load_loads_it(path: Path) -> None:
    raw = path.read_bytes()
    fast = _load_plain(raw, DEFAULT_LIMITS)
    if fast is None:  # not plain: the careful path reads it (checked below)
        return
    assert same(fast, loaded(raw))


@pytest.mark.parametrize(
    "text",
    [
        # YAML 1.1's spellings that SafeLoader turns into other types
        "a: yes\nb: No\nc: on\nd: OFF\ne: ~\nf: null\ng: Null\n",
        "a: 0o17\nb: 017\nc: 0x1F\nd: 1_000\ne: 0b101\nf: +12\ng: -0\nh: 190:20:30\n",
        "a: .inf\nb: -.Inf\nc: .NaN\nd: 1.5e3\ne: 6.8523015e+5\nf: 1_0.5\ng: 1e3\n",
        "a: '123'\nb: \"true\"\nc: 'null'\nd: |\n  two\n  lines\ne: >\n  folded\n  text\n",
        "1: one\n2.5: two\ntrue: three\n~: four\n",
        "a: 1\na: 2\nb: [1, {c: d}, [e]]\n",  # a repeated key: the last value
        "[1, two, {three: 3}]",
        "just a scalar",
        "a: {}\nb: []\nc: [[], {}]\n",
        "a:\n  - b: 1\n    c: 2\n  - - x\n    - y\n",
        "%YAML 1.1\n---\na: 1\n...\n",
    ],
)
def test_plain_documents_load_in_one_pass_as_yaml_load_loads_them(text: str) -> None:
    fast = _load_plain(text.encode(), DEFAULT_LIMITS)
    assert fast is not None
    assert same(fast, loaded(text))


@pytest.mark.parametrize(
    "text",
    [
        "a: &x 1\nb: *x\n",  # an anchor and an alias
        "a: !!str 1\n",  # an explicit tag
        "a: !!binary aGVsbG8=\n",
        "a: !!set {x, y}\n",
        "base: &b {x: 1}\nc:\n  <<: *b\n  y: 2\n",  # a merge key
        "d: 2001-12-14\n",  # a timestamp
        "? [a, b]\n: c\n",  # a collection as a key
        "a: 1\n---\nb: 2\n",  # two documents
        "",  # empty
        "a: [1, 2\n",  # not valid YAML
    ],
)
def test_other_documents_take_the_careful_path(text: str) -> None:
    assert _load_plain(text.encode(), DEFAULT_LIMITS) is None


def test_the_careful_path_still_reads_what_the_one_pass_leaves_to_it() -> None:
    m = parse_manifest(
        "name: &n job\ndescription: *n\nframework: {command: c}\nenv: {A: !!str 1}\n"
    )
    assert (m.description, dict(m.env)) == ("job", {"A": "1"})


def test_the_limits_hold_on_the_one_pass() -> None:
    tight = Limits(max_depth=3, max_nodes=10)
    assert _load_plain(b"a: {b: {c: 1}}", tight) is not None  # depth 3, 6 nodes
    assert _load_plain(b"a: {b: {c: {d: 1}}}", tight) is None  # depth 4
    assert _load_plain(b"[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]", tight) is None  # 11 nodes
    with pytest.raises(ManifestError, match="nests deeper than 3 levels"):
        parse_manifest("a: {b: {c: {d: 1}}}", limits=tight)
    with pytest.raises(ManifestError, match="more than 10 values"):
        parse_manifest("[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]", limits=tight)


# -- random plain data, written out as YAML in several styles ---------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["yes", "off", "~", "0o17", "1_0", ".inf", "<<x", "=", "a: b", "- x", "#"]),
)
keys = st.one_of(st.text(max_size=8), st.integers(-5, 5), st.booleans(), st.none())
plain_data = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=4)),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=plain_data, flow=st.sampled_from([None, True, False]), width=st.sampled_from([8, 80]))
def test_random_plain_yaml_loads_in_one_pass_as_yaml_load_loads_it(
    data: Any, flow: bool | None, width: int
) -> None:
    text = yaml.safe_dump(data, default_flow_style=flow, width=width, allow_unicode=True)
    fast = _load_plain(text.encode(), DEFAULT_LIMITS)
    if fast is None:  # e.g. a key that dumps as a merge key: the careful path reads it
        return
    assert same(fast, loaded(text))


# -- jsonschema_rs's yes is jsonschema's yes --------------------------------------------

BASE: dict[str, Any] = {"name": "x", "framework": {"command": "python t.py"}}
FIELDS = [
    "name", "description", "version", "learners", "gpus", "cpus", "memory", "gpu_type",
    "priority", "max_learner_restarts", "max_preemptions", "env", "data_stores",
    "evaluation_metrics", "pipeline", "checkpoint", "elastic", "instance_type", "zones",
    "estimate", "framework",
]  # fmt: skip
KEYS = [
    "type", "command", "stages", "pipelines", "min", "max", "policy", "id", "A", "in",
    "keep", "standbys", "container", "x", "1",
]  # fmt: skip
values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**66), max_value=2**66),
        st.sampled_from([0, 1, 2, 16, 17, 64, 100, 101, 256, 1024, 1025, 1.0, 0.5, -1]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=6),
        st.sampled_from(
            ["", "a b", "ab\n", "\x00", "1Gb", "logger", "none", "fixed", "local", "A_1", "1A"]
        ),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(KEYS),
            inner,
            max_size=3,
        ),
    ),
    max_leaves=8,
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=st.dictionaries(st.sampled_from(FIELDS), values, max_size=4))
def test_jsonschema_rs_accepts_nothing_that_jsonschema_refuses(changes: dict[str, Any]) -> None:
    document = {**BASE, **changes}
    if _surely_valid(document):
        assert _validator().is_valid(document), document


@pytest.mark.parametrize(
    "text",
    [
        "name: x\nframework: {command: c}\ncpus: .nan\n",  # NaN compares false: jsonschema passes it
        'name: "ab\\n"\nframework: {command: c}\n',  # Python's `$` matches before a final \n
    ],
)
def test_what_jsonschema_rs_refuses_and_jsonschema_accepts_is_still_accepted(text: str) -> None:
    parse_manifest(text)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("name: x\nframework: {command: c}\ndescription: 2001-12-14\n", "should be of type string"),
        ("name: x\nframework: {command: c}\nenv: {A: !!binary aGk=}\n", "b'hi' should be of type"),
    ],
)
def test_values_jsonschema_rs_cannot_read_are_described_by_jsonschema(
    text: str, fragment: str
) -> None:
    with pytest.raises(ManifestError, match=fragment):
        parse_manifest(text)
