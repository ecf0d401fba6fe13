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
        ("name: 'a b'\nframework: {command: x}", "name", "letters, digits"),
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


def test_pipeline_shape_fills_in_learners() -> None:
    m = parse_manifest("name: a\nframework: {command: x}\npipeline: {stages: 3, pipelines: 2}")
    assert m.learners == 6


@pytest.mark.parametrize(
    ("value", "mb"),
    [(512, 512.0), ("512MiB", 512.0), ("1Gb", 1024.0), ("2GB", 2048.0), ("1.5G", 1536.0)],
)
def test_memory_units(value: object, mb: float) -> None:
    assert parse_memory_mb(value) == mb
