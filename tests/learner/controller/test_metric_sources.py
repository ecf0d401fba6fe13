"""Metric sources extract the right values from real files.

The TensorBoard fixture under data/tb was written by torch.utils.tensorboard.SummaryWriter
(torch 2.13 with tensorboard 2.21.0 installed aside, not in Rhizome's environment):

    w = SummaryWriter("data/tb", filename_suffix=".rhizome")
    for s in range(5):
        w.add_scalar("loss", 1.0 / (s + 1), s)                # classic simple_value
        w.add_scalar("acc", 0.5 + 0.1 * s, s, new_style=True)  # a float tensor
    w.add_text("note", "not a scalar", 0); w.add_histogram("weights", torch.arange(10.0), 0)
    e = SummaryWriter("data/tb/eval", ...); e.add_scalar("accuracy", s / 100, s) for s in (10, 20)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from learner.controller.metric_sources import MetricSourceError, create_sources
from learner.controller.metric_sources.tail import LineTailer
from learner.controller.metric_sources.tensorboard import (
    Event,
    masked_crc32c,
    read_records,
    write_record,
)

DATA = Path(__file__).parent / "data"


def _vals(samples: list) -> list[tuple[str, int, float]]:
    return [(s.name, s.step, round(s.value, 6)) for s in samples]


# -- regex_extractor ---------------------------------------------------------------------


def test_regex_named_groups_become_scalars_at_their_step(tmp_path: Path) -> None:
    (src,) = create_sources(
        {
            "type": "regex_extractor",
            "in": "stdout",
            "regex": r"step (?P<step>\d+) loss=(?P<loss>[\d.]+) acc=(?P<acc>[\d.]+)",
        },
        tmp_path,
    )
    assert src.stream == "stdout"
    got = src.feed(["noise", "step 3 loss=0.25 acc=0.9", "step 4 loss=0.5 acc=x"], final=False)
    assert _vals(got) == [("loss", 3, 0.25), ("acc", 3, 0.9)]


def test_regex_groups_vars_and_line_lookahead_span_lines(tmp_path: Path) -> None:
    (src,) = create_sources(
        {
            "type": "regex_extractor",
            "in": "logs/train.log",
            "line_lookahead": 2,
            "eval_metric_vars": ["loss", "iteration"],
            "groups": {
                "train": {"regex": r"Iteration $iteration\n.*loss = $loss", "step": "iteration"},
                "test": {"regex": r"Test accuracy: (?P<accuracy>[\d.]+)"},
            },
        },
        tmp_path,
    )
    log = tmp_path / "logs" / "train.log"
    log.parent.mkdir()
    log.write_text(
        "Iteration 100\n  Train net output #0: loss = 0.75\nTest accuracy: 0.5\nIteration 200\n"
    )
    first = src.poll(final=False, max_records=100)
    assert _vals(first) == [("train/loss", 100, 0.75), ("test/accuracy", 0, 0.5)]
    with log.open("a") as f:
        f.write("  Train net output #0: loss = 1e-3\n")
    assert _vals(src.poll(final=True, max_records=100)) == [("train/loss", 200, 0.001)]


def test_regex_state_resumes_a_half_seen_window(tmp_path: Path) -> None:
    spec = {
        "type": "regex_extractor",
        "line_lookahead": 2,
        "regex": r"epoch (?P<step>\d+)\nval=(?P<val>[\d.]+)",
    }
    (a,) = create_sources(spec, tmp_path)
    assert a.feed(["epoch 1"], final=False) == []
    (b,) = create_sources(spec, tmp_path)
    b.restore(json.loads(json.dumps(a.state())))
    assert _vals(b.feed(["val=0.5"], final=False)) == [("val", 1, 0.5)]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"type": "regex_extractor"}, "needs a 'regex'"),
        ({"type": "regex_extractor", "regex": "loss=(\\d"}, "does not compile"),
        ({"type": "regex_extractor", "regex": "loss=\\d+"}, "no named group"),
        ({"type": "regex_extractor", "regex": "loss=$loss"}, "eval_metric_vars does not define"),
        ({"type": "regex_extractor", "regex": "(?P<a>1)", "line_lookahead": 0}, "must be >= 1"),
        ({"type": "nope"}, "use one of"),
        ("tensorboard", "must be a mapping"),
    ],
)
def test_bad_specs_name_the_problem(tmp_path: Path, spec: object, message: str) -> None:
    with pytest.raises(MetricSourceError, match=message):
        create_sources(spec, tmp_path)


def test_two_sources_of_one_type_get_distinct_ids(tmp_path: Path) -> None:
    ids = [
        s.source_id
        for s in create_sources(
            [
                {"type": "emetrics_file"},
                {"type": "emetrics_file", "in": "b.txt"},
                {"type": "logger"},
            ],
            tmp_path,
        )
    ]
    assert ids == ["emetrics_file", "emetrics_file.1", "logger"]


# -- emetrics_file -----------------------------------------------------------------------


def test_emetrics_reads_ffdl_and_flat_lines_and_skips_bad_ones(tmp_path: Path) -> None:
    (src,) = create_sources({"type": "emetrics_file", "in": "$JOB_STATE_DIR/em.txt"}, tmp_path)
    ffdl = {
        "meta": {"time": 1700000000123, "rindex": 1},
        "grouplabel": "test",
        "etimes": {"iteration": {"type": 2, "value": 40}},
        "values": {"accuracy": {"type": 3, "value": 0.875}, "loss": 0.25},
    }
    flat = {"step": 7, "time": 1700000001.5, "lr": 0.01, "note": "text"}
    (tmp_path / "em.txt").write_text(
        json.dumps(ffdl) + "\n{not json\n" + json.dumps(flat) + '\n{"step"'
    )
    got = src.poll(final=False, max_records=100)
    assert _vals(got) == [("test/accuracy", 40, 0.875), ("test/loss", 40, 0.25), ("lr", 7, 0.01)]
    assert got[0].time_us == 1700000000123000 and got[2].time_us == 1700000001500000
    assert src.bad_lines == 1  # type: ignore[attr-defined]
    # The unterminated last line is held back until it is complete.
    with (tmp_path / "em.txt").open("a") as f:
        f.write(': 8, "lr": 0.02}\n')
    assert _vals(src.poll(final=False, max_records=100)) == [("lr", 8, 0.02)]


# -- tensorboard -------------------------------------------------------------------------


def test_tensorboard_reads_scalars_of_a_real_summary_writer_file(tmp_path: Path) -> None:
    shutil.copytree(DATA / "tb", tmp_path / "tb")
    (src,) = create_sources({"type": "tensorboard", "in": "tb"}, tmp_path)
    got = sorted(_vals(src.poll(final=True, max_records=1000)))
    expected = sorted(
        [("loss", s, round(1.0 / (s + 1), 6)) for s in range(5)]
        + [("acc", s, round(0.5 + 0.1 * s, 6)) for s in range(5)]
        + [("eval/accuracy", 10, 0.1), ("eval/accuracy", 20, 0.2)]
    )
    assert got == expected  # text and histogram summaries are not scalars
    assert src.poll(final=True, max_records=1000) == []  # nothing read twice


def test_tensorboard_waits_for_a_record_being_written_and_resumes(tmp_path: Path) -> None:
    ev = Event(wall_time=1700000000.0, step=3)
    v = ev.summary.value.add(tag="loss")
    v.simple_value = 0.5
    frame = write_record(ev.SerializeToString())
    (tmp_path / "tb").mkdir()
    f = tmp_path / "tb" / "events.out.tfevents.1.host"
    f.write_bytes(frame[:-5])  # a writer mid-record
    (src,) = create_sources({"type": "tensorboard", "in": "tb"}, tmp_path)
    assert src.poll(final=False, max_records=10) == []
    f.write_bytes(frame + frame)
    (again,) = create_sources({"type": "tensorboard", "in": "tb"}, tmp_path)
    again.restore(src.state())
    got = again.poll(final=False, max_records=10)
    assert [(s.name, s.step, s.value, s.time_us) for s in got] == [
        ("loss", 3, 0.5, 1700000000000000)
    ] * 2


def test_tfrecord_checksums_are_checked() -> None:
    assert masked_crc32c(b"") == 0xA282EAD8  # the mask of CRC-32C("") == 0
    frame = bytearray(write_record(b"payload"))
    assert read_records(bytes(frame)) == ([b"payload"], len(frame))
    frame[14] ^= 0xFF
    with pytest.raises(ValueError, match="checksum"):
        read_records(bytes(frame))


# -- tailing -----------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
# a line of exactly the limit whose newline comes in a later write (found by hypothesis)
@example(text="aaa\n", cuts=[3], max_line=3)
@given(
    text=st.text(alphabet="ab\n", max_size=60),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=5),
    max_line=st.integers(min_value=2, max_value=8),
)
def test_lines_are_cut_the_same_however_the_file_grows(
    tmp_path_factory: pytest.TempPathFactory, text: str, cuts: list[int], max_line: int
) -> None:
    path = tmp_path_factory.mktemp("tail") / "out.log"
    data = text.encode()
    path.write_bytes(b"")
    chunked = LineTailer(path, max_line_bytes=max_line)
    got: list[str] = []
    for cut in sorted({*cuts, len(data)}):
        path.write_bytes(data[: min(cut, len(data))])
        got += chunked.read_lines(3)
    got += chunked.read_lines(10_000, final=True)
    whole = LineTailer(path, max_line_bytes=max_line).read_lines(10_000, final=True)
    assert got == whole
    assert "".join(whole).replace("\n", "") == text.replace("\n", "")
