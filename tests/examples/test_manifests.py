"""Every example's manifest is one the API accepts (a user copies them first)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.manifest import parse_manifest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MANIFESTS = sorted([*EXAMPLES.glob("*/manifest.yml"), *EXAMPLES.glob("*/manifest.yaml")])


def test_the_examples_have_manifests() -> None:
    assert {p.parent.name for p in MANIFESTS} >= {"mnist", "pipeline-gpt"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.parent.name)
def test_every_example_manifest_validates(path: Path) -> None:
    manifest = parse_manifest(path.read_bytes())
    assert manifest.command  # something to run
