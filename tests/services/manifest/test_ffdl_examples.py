"""FfDL's own published example manifests are accepted (we promise FfDL's manifests).

The copies live in tests/data/ffdl_examples/ (NOTICE.md there says where they come from
and under which license). Six of them name their job with spaces ("pytorch ddl"), which
FfDL allowed: they keep that name for display and get a safe one for the record.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from services.manifest import ManifestError, parse_manifest, safe_name

EXAMPLES = Path(__file__).resolve().parents[2] / "data" / "ffdl_examples"
MANIFESTS = sorted(EXAMPLES.glob("*.yml"))
SAFE = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


def test_all_twenty_of_ffdls_published_examples_are_here() -> None:
    assert len(MANIFESTS) == 20, [p.name for p in MANIFESTS]


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.stem for p in MANIFESTS])
def test_ffdl_example_manifest_is_accepted(path: Path) -> None:
    manifest = parse_manifest(path.read_bytes())
    written = str(manifest.document["name"])
    assert manifest.display_name == written
    assert manifest.name == safe_name(written)
    assert re.match(SAFE, manifest.name), manifest.name


def test_names_with_spaces_keep_their_display_name_and_get_a_safe_one() -> None:
    manifest = parse_manifest((EXAMPLES / "pytorch-launch-dist__manifest.yml").read_bytes())
    assert manifest.display_name == "pytorch ddl"
    assert manifest.name == "pytorch-ddl"
    spaced = [p for p in MANIFESTS if " " in str(parse_manifest(p.read_bytes()).display_name)]
    assert len(spaced) == 6


def test_a_safe_name_is_unchanged() -> None:
    assert safe_name("mnist-pytorch_model.v2") == "mnist-pytorch_model.v2"
    assert (
        safe_name("  Pytorch DDL on torchvision dataset ") == "Pytorch-DDL-on-torchvision-dataset"
    )


@pytest.mark.parametrize("name", ["   ", "é ü", "line\nbreak", "tab\tname", "---"])
def test_a_name_without_letters_or_with_control_characters_is_refused(name: str) -> None:
    with pytest.raises(ManifestError) as err:
        parse_manifest(f"name: {json.dumps(name)}\nframework:\n  command: python t.py\n".encode())
    assert err.value.field == "name"
