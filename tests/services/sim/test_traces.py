"""The spot traces ship with the package: a bare name works from any checkout."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.sim import traces


def test_bundled_traces_load_by_bare_name_without_any_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RHIZOME_TRACES_DIR", raising=False)
    assert {"aws-p3-64.csv", "aws-g4dn-64.csv"} <= set(traces.bundled())
    p3 = traces.load("aws-p3-64.csv")
    assert len(p3.removals()) == 167  # the count the traces' README gives
    assert p3.peak_size <= 64 + 16


def test_the_traces_dir_setting_is_searched_before_the_bundled_ones(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "aws-p3-64.csv").write_text("0,add,n1\n1000,remove,n1\n")
    monkeypatch.setenv("RHIZOME_TRACES_DIR", str(tmp_path))
    assert len(traces.load("aws-p3-64.csv").events) == 2


def test_an_unknown_trace_name_says_where_it_looked_and_what_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RHIZOME_TRACES_DIR", raising=False)
    with pytest.raises(traces.TraceError, match=r"not found.*aws-g4dn-64\.csv"):
        traces.load("no-such-trace.csv")
