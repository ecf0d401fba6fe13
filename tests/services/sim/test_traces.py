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


# --- issue #20: the formats people have, and one-line errors for everything else --------


def _load(tmp_path: Path, text: str) -> traces.Trace:
    p = tmp_path / "t.csv"
    p.write_text(text)
    return traces.load(p)


def test_the_gcp_count_format_becomes_adds_and_removes(tmp_path: Path) -> None:
    trace = _load(
        tmp_path,
        "date,time,count\n"
        "2022-03-01, 10:00:00, 3\n"
        "2022-03-01, 10:00:30, 1\n"
        "2022-03-01, 10:00:30, 2\n"  # a repeated timestamp: the count changed twice
        "2022-03-01, 11:00:00, 0\n",
    )
    assert trace.format == "counts"
    assert [(e.t_s, e.kind) for e in trace.events] == [
        (0.0, "add"),
        (0.0, "add"),
        (0.0, "add"),
        (30.0, "remove"),
        (30.0, "remove"),
        (30.0, "add"),
        (3600.0, "remove"),
        (3600.0, "remove"),
    ]
    assert [alive for _t, alive in trace.removals_with_cluster_size()] == [3, 2, 2, 1]
    assert trace.peak_size == 3


def test_the_aws_event_format_still_loads_with_a_header(tmp_path: Path) -> None:
    trace = _load(tmp_path, "ms,event,node\n0,add,a\n0,add,b\n2000,remove,a\n")
    assert trace.format == "events" and [e.t_s for e in trace.removals()] == [2.0]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "the trace is empty"),
        ("\n\n", "the trace is empty"),
        ("0,add,a\n5000,remove,a\n1000,add,b\n", ":3: time goes backwards"),
        ("0,add,a\n0,add,b\n0,add,a\n900,remove,a\n", ":3: duplicate row (same as line 1)"),
        ("2022-03-01,10:00:05,3\n2022-03-01,10:00:01,2\n", ":2: time goes backwards"),
        ("2022-03-01,10:00:05,3\n2022-03-01,10:00:05,3\n", ":2: duplicate row"),
        ("node,started,stopped\na,1,2\n", ":2: unknown trace format"),
        ("1,2,3,4\n", ":1: unknown trace format"),
        ("0,add,a\n10,preempt,a\n", ":2: expected '<ms>,<add|remove>,<node>'"),
        ("0,add,a\nsoon,remove,a\n", ":2: time 'soon' is not a number"),
        ("2022-03-01,10:00:05,3\n2022-03-01,10:00:09,many\n", ":2: node count 'many'"),
        ("2022-03-01,10:00:05,3\n2022-03-01,10:00:09,4\n", "no preemptions"),
    ],
)
def test_bad_traces_are_one_line_naming_the_problem_and_line(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(traces.TraceError) as err:
        _load(tmp_path, text)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_rows_close_in_time_late_in_a_long_trace_are_not_duplicates(tmp_path: Path) -> None:
    # 123456789 and 123457000 ms print alike with 6 significant digits; they differ.
    trace = _load(tmp_path, "0,add,a\n123456789,remove,a\n123457000,remove,a\n")
    assert [e.t_s for e in trace.removals()] == [123456.789, 123457.0]
