"""Manifest validation: every bad manifest gets an error naming the field and the fix."""

from __future__ import annotations

import pytest

from services.manifest import ManifestError, parse_manifest, parse_memory_mb

GOOD = """
name: mnist
description: digits
learners: 2
gpus: 0
cpus: 1
memory: 1Gb
framework:
  name: pytorch
  version: "2.13"
  command: python train.py
evaluation_metrics:
  type: logger
"""


def test_a_good_ffdl_manifest_parses_with_resources() -> None:
    m = parse_manifest(GOOD)
    assert m.name == "mnist"
    assert m.command == "python train.py"
    assert m.resources.as_dict() == {
        "learners": 2,
        "gpus": 0.0,
        "cpus": 1.0,
        "memory_mb": 1024.0,
        "gpu_type": "",
    }


@pytest.mark.parametrize(
    ("text", "field", "fragment"),
    [
        ("name: a\nframework: {command: x}\nlearners: -1", "learners", "minimum of 1"),
        ("name: a\nframework: {command: x}\nlearners: 100000", "learners", "maximum of 1024"),
        ("name: a\nframework: {command: x}\ngpus: -2", "gpus", "minimum of 0"),
        ("name: a\nframework: {command: x}\nlernerz: 2", "lernerz", "unknown field"),
        ("name: a\nframework: {command: x, comand: y}", "framework.comand", "unknown field"),
        ("name: a\nframework: {}", "framework.command", "is required"),
        ("framework: {command: x}", "name", "is required"),
        ("name: a\nframework: {command: x}\nlearners: two", "learners", "type integer"),
        ("name: a\nframework: {command: x}\nmemory: 12 parsecs", "memory", "not a size"),
        ("name: a\nframework: {command: x}\nmemory: 0", "memory", "out of range"),
        ("name: '-- --'\nframework: {command: x}", "name", "at least one letter or digit"),
        (
            "name: a\nframework: {command: x}\npipeline: {stages: 2, redundancy: eager}",
            "pipeline.redundancy",
            "choose one of",
        ),
        (
            "name: a\nframework: {command: x}\npipeline: {stages: 2, pipelines: 2}\nlearners: 3",
            "learners",
            "pipeline shape",
        ),
        ("name: a\nframework: {command: x}\npipeline: {stages: 65}", "pipeline.stages", "64"),
        (
            "name: a\nframework: {command: x}\npipeline: {stages: 2, microbatches: 0}",
            "pipeline.microbatches",
            "minimum of 1",
        ),
        (
            "name: a\nframework: {command: x}\npipeline: {stages: 2, microbatches: 256}",
            "pipeline.microbatches",
            "maximum of 255",
        ),
        (
            "name: a\nframework: {command: x}\npipeline: {stages: 2, metrics_every: 0}",
            "pipeline.metrics_every",
            "minimum of 1",
        ),
        (
            "name: a\nframework: {command: x}\npipeline: {stages: 2, metrics_every: ten}",
            "pipeline.metrics_every",
            "integer",
        ),
        (
            "name: a\nframework: {command: x}\npipeline: {stages: 2, standbys: -1}",
            "pipeline.standbys",
            "minimum of 0",
        ),
        (
            "name: a\nframework: {command: x}\npipeline: {stages: 2, standbys: 65}",
            "pipeline.standbys",
            "maximum of 64",
        ),
        (
            "name: a\nframework: {command: x}\npipeline: {stages: 2, standbys: two}",
            "pipeline.standbys",
            "integer",
        ),
        (
            "name: a\nframework: {command: x}\npipeline: {stages: 64, pipelines: 16, standbys: 1}",
            "pipeline",
            "stages × pipelines + standbys = 1025",
        ),
        (
            "name: a\nframework: {command: x}\npipeline: {stages: 64, pipelines: 32}",
            "pipeline",
            "at most 1024",
        ),
        (
            "name: a\nframework: {command: python -m learner.runtime.launch --stages 2 t.py}\n"
            "pipeline: {stages: 2}",
            "framework.command",
            "learners are its workers",
        ),
        ("name: a\nframework: {command: x}\nelastic: {min: 4, max: 2}", "elastic.min", "larger"),
        (
            "name: a\nframework: {command: x}\nevaluation_metrics: {type: csv}",
            "evaluation_metrics.type",
            "choose one of",
        ),
    ],
)
def test_bad_manifests_name_the_field(text: str, field: str, fragment: str) -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest(text)
    assert info.value.field == field
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("name: a\n framework: [", "not valid YAML at line 2"),
        ("", "empty"),
        ("- 1\n- 2", "YAML mapping"),
        ("x" * 300_000, "at most"),
    ],
)
def test_unparseable_manifests_say_why(text: str, fragment: str) -> None:
    with pytest.raises(ManifestError, match=fragment):
        parse_manifest(text)


def test_the_pipeline_example_manifest_is_valid() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "examples/pipeline-gpt/manifest.yaml").read_text()
    m = parse_manifest(text)
    assert m.pipeline is not None and m.learners == m.pipeline.workers == 2
    assert "learner.runtime.launch" not in m.command


def test_pipeline_shape_fills_in_learners() -> None:
    m = parse_manifest("name: a\nframework: {command: x}\npipeline: {stages: 3, pipelines: 2}")
    assert m.learners == 6


@pytest.mark.parametrize(
    ("value", "mb"),
    [(512, 512.0), ("512MiB", 512.0), ("1Gb", 1024.0), ("2GB", 2048.0), ("1.5G", 1536.0)],
)
def test_memory_units(value: object, mb: float) -> None:
    assert parse_memory_mb(value) == mb


def _bomb(levels: int) -> str:
    """A 'billion laughs' document: each level refers nine times to the one before."""
    text = "name: a\nframework: {command: x}\nenv:\n  L0: &l0 [x, x, x, x, x, x, x, x, x]\n"
    for i in range(1, levels):
        text += f"  L{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]\n"
    return text


def test_an_alias_bomb_is_refused_before_it_expands() -> None:
    text = _bomb(8)  # 9**8 = 43 million values from under 400 bytes
    assert len(text) < 600
    with pytest.raises(ManifestError, match="expands to more than 20000 values"):
        parse_manifest(text)


def test_too_many_aliases_are_refused_even_when_each_is_small() -> None:
    text = "name: a\nframework: {command: x}\nv: &v 1\nenv:\n" + "".join(
        f"  K{i}: *v\n" for i in range(100)
    )
    with pytest.raises(ManifestError, match="more than 64 YAML aliases"):
        parse_manifest(text)


def test_a_deeply_nested_manifest_is_refused_without_recursing() -> None:
    text = "name: a\nframework: {command: x}\nenv: " + "[" * 50_000 + "]" * 50_000
    with pytest.raises(ManifestError, match="deeper than 32 levels"):
        parse_manifest(text)


def test_a_few_aliases_are_still_fine() -> None:
    m = parse_manifest("name: a\nframework: {command: &c python t.py}\nenv: {CMD: *c}\n")
    assert m.env == {"CMD": "python t.py"}


def test_non_utf8_bytes_name_the_offset() -> None:
    with pytest.raises(ManifestError, match=r"not UTF-8 text \(byte 0xff at offset 6\)"):
        parse_manifest(b"name: \xff\xfe\nframework: {command: x}\n")


@pytest.mark.parametrize(
    ("field", "text"),
    [
        ("checkpoint.interval_s", "checkpoint: {interval_s: 1.0e+300}"),
        ("checkpoint.grace_s", "checkpoint: {grace_s: 99999}"),
        ("checkpoint.keep", "checkpoint: {keep: 9223372036854775808}"),
        ("priority", "priority: -9223372036854775809"),
        ("elastic.min", "elastic: {min: 5000, max: 8}"),
    ],
)
def test_out_of_range_numbers_name_the_field(field: str, text: str) -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest(f"name: a\nframework: {{command: x}}\n{text}\n")
    assert info.value.field == field


def test_standbys_are_learners_beyond_the_workers() -> None:
    m = parse_manifest(
        "name: a\nframework: {command: x}\npipeline: {stages: 2, pipelines: 2, standbys: 1}"
    )
    assert m.pipeline is not None and m.pipeline.standbys == 1
    assert m.pipeline.workers == 4 and m.learners == 5  # the scheduler places all five
    plain = parse_manifest("name: a\nframework: {command: x}\npipeline: {stages: 2}")
    assert plain.pipeline is not None and plain.pipeline.standbys == 0 and plain.learners == 2
