"""`pipeline.max_pipelines`: how far P queued standbys may grow a pipeline job (D+1).

Out of range is refused naming the field; left out, a job never grows (its shape stays
the one asked for, as before the field existed).
"""

from __future__ import annotations

import pytest

from services.manifest import ManifestError, parse_manifest

HEAD = "name: a\nframework: {command: x}\n"


@pytest.mark.parametrize(
    ("pipeline", "fragment"),
    [
        ("{stages: 2, pipelines: 2, max_pipelines: 1}", "below pipeline.pipelines (2)"),
        ("{stages: 2, max_pipelines: 0}", "minimum of 1"),
        ("{stages: 2, max_pipelines: 257}", "maximum of 256"),
        ("{stages: 2, max_pipelines: two}", "integer"),
    ],
)
def test_max_pipelines_out_of_range_is_refused_naming_the_field(
    pipeline: str, fragment: str
) -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest(f"{HEAD}pipeline: {pipeline}")
    assert info.value.field == "pipeline.max_pipelines"
    assert fragment in str(info.value)


def test_max_pipelines_defaults_to_the_pipelines_asked_for() -> None:
    plain = parse_manifest(f"{HEAD}pipeline: {{stages: 2, pipelines: 3}}")
    assert plain.pipeline is not None and plain.pipeline.max_pipelines == 3
    grow = parse_manifest(
        f"{HEAD}pipeline: {{stages: 2, pipelines: 1, standbys: 2, max_pipelines: 2}}"
    )
    assert grow.pipeline is not None
    assert (grow.pipeline.max_pipelines, grow.pipeline.standbys, grow.learners) == (2, 2, 4)
