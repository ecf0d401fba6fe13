"""The collector against an in-process TDS over real gRPC, backed by the in-memory store."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from contract.env import learner_dir
from learner.controller.collector import OFFSETS_FILE, Collector, CollectorError
from services.tds.api import Query
from services.tds.memory_store import MemoryStore
from tests.services.tds.helpers import tds_in_process


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def tds(store: MemoryStore) -> Iterator[str]:
    with tds_in_process(store) as (addr, _):
        yield addr


def _write(job_dir: Path, stream: str, text: str, learner: int = 0) -> None:
    d = learner_dir(job_dir, learner)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"{stream}.log", "a") as f:
        f.write(text)


def _stored(store: MemoryStore, job: str, stream: str) -> list[tuple[int, str]]:
    return [(ln.seq, ln.line) for ln in store.query_logs(Query(job)) if ln.stream == stream]


def _wait(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.02)
    assert cond(), "condition not reached"  # type: ignore[operator]


def test_lines_are_shipped_numbered_and_their_offsets_committed(
    tmp_path: Path, store: MemoryStore, tds: str
) -> None:
    _write(tmp_path, "stdout", "".join(f"out {i}\n" for i in range(50)))
    _write(tmp_path, "stderr", "err 0\nerr 1\nunterminated")
    c = Collector("job1", 0, tmp_path, tds, batch_lines=7).start()
    _wait(lambda: len(_stored(store, "job1", "stdout")) == 50)
    # An unterminated line waits for its end while the learner runs...
    assert _stored(store, "job1", "stderr") == [(0, "err 0"), (1, "err 1")]
    assert c.stop(drain=True)
    # ...and is shipped when the learner is done.
    assert _stored(store, "job1", "stderr")[-1] == (2, "unterminated")
    assert _stored(store, "job1", "stdout") == [(i, f"out {i}") for i in range(50)]
    offsets = json.loads((learner_dir(tmp_path, 0) / OFFSETS_FILE).read_text())
    assert offsets["streams"]["stdout"] == {
        "offset": (learner_dir(tmp_path, 0) / "stdout.log").stat().st_size,
        "seq": 50,
    }


def test_a_restart_from_an_older_commit_overwrites_instead_of_duplicating(
    tmp_path: Path, store: MemoryStore, tds: str
) -> None:
    _write(tmp_path, "stdout", "".join(f"a{i}\n" for i in range(10)))
    assert Collector("job2", 0, tmp_path, tds).start().stop(drain=True)
    stale = (learner_dir(tmp_path, 0) / OFFSETS_FILE).read_text()
    _write(tmp_path, "stdout", "".join(f"b{i}\n" for i in range(10)))
    assert Collector("job2", 0, tmp_path, tds).start().stop(drain=True)
    # A crash between the TDS's ack and the commit leaves the older offsets behind.
    (learner_dir(tmp_path, 0) / OFFSETS_FILE).write_text(stale)
    _write(tmp_path, "stdout", "c0\n")
    assert Collector("job2", 0, tmp_path, tds).start().stop(drain=True)
    expected = [f"a{i}" for i in range(10)] + [f"b{i}" for i in range(10)] + ["c0"]
    assert _stored(store, "job2", "stdout") == list(enumerate(expected))


def test_collector_holds_its_place_while_the_tds_is_down(
    tmp_path: Path, store: MemoryStore, tds: str
) -> None:
    store.available = False
    _write(tmp_path, "stdout", "x\ny\n")
    c = Collector("job3", 0, tmp_path, tds, max_backoff_s=0.1).start()
    time.sleep(0.5)
    assert not (learner_dir(tmp_path, 0) / OFFSETS_FILE).exists()  # nothing acknowledged
    store.available = True
    assert c.stop(drain=True)
    assert _stored(store, "job3", "stdout") == [(0, "x"), (1, "y")]


def test_stop_without_drain_gives_up_a_batch_the_tds_never_took(
    tmp_path: Path, store: MemoryStore, tds: str
) -> None:
    store.available = False
    _write(tmp_path, "stdout", "x\n")
    c = Collector("job4", 0, tmp_path, tds, max_backoff_s=0.05).start()
    time.sleep(0.4)
    t = threading.Thread(target=c.stop, kwargs={"drain": False})
    t.start()
    t.join(10)
    assert not t.is_alive()
    assert not (learner_dir(tmp_path, 0) / OFFSETS_FILE).exists()


def test_metric_sources_ship_samples_with_per_source_seqs(
    tmp_path: Path, store: MemoryStore, tds: str
) -> None:
    _write(tmp_path, "stdout", "step 1 loss=0.5\nhello\nstep 2 loss=0.25\n")
    (learner_dir(tmp_path, 0) / "evaluation-metrics.txt").write_text('{"step": 2, "acc": 0.75}\n')
    sources = [
        {"type": "regex_extractor", "regex": r"step (?P<step>\d+) loss=(?P<loss>[\d.]+)"},
        {"type": "emetrics_file"},
    ]
    assert Collector("job5", 0, tmp_path, tds, metric_sources=sources).start().stop(drain=True)
    got = sorted(
        (m.source, m.seq, m.name, m.step, m.value) for m in store.query_metrics(Query("job5"))
    )
    assert got == [
        ("emetrics_file", 0, "acc", 2, 0.75),
        ("regex_extractor", 0, "loss", 1, 0.5),
        ("regex_extractor", 1, "loss", 2, 0.25),
    ]
    assert len(_stored(store, "job5", "stdout")) == 3


def test_offsets_of_another_job_are_refused(tmp_path: Path, tds: str) -> None:
    d = learner_dir(tmp_path, 0)
    d.mkdir(parents=True)
    (d / OFFSETS_FILE).write_text(json.dumps({"job_id": "other", "learner": 0, "streams": {}}))
    with pytest.raises(CollectorError, match="belongs to job 'other'"):
        Collector("job6", 0, tmp_path, tds)


def test_a_quiet_collector_sleeps_on_its_files_and_a_line_wakes_it(
    tmp_path: Path, store: MemoryStore, tds: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With inotify the collector does not poll: with its safety net and the poll interval
    out of reach, a line written after a quiet spell is still shipped (issue #16)."""
    from learner.controller import collector as collector_module

    monkeypatch.setattr(collector_module, "IDLE_SAFETY_S", 3600.0)
    _write(tmp_path, "stdout", "first\n")
    c = Collector("job-quiet", 0, tmp_path, tds, poll_interval_s=3600.0, verify_interval_s=0)
    if c.watched_files() is None or collector_module.FileWait.open(c.watched_files() or []) is None:
        pytest.skip("no inotify here")
    c.start()
    _wait(lambda: _stored(store, "job-quiet", "stdout") == [(0, "first")])
    time.sleep(0.3)  # asleep on its files now
    _write(tmp_path, "stdout", "second\n")
    _wait(lambda: len(_stored(store, "job-quiet", "stdout")) == 2)
    assert c.stop(drain=True)
    assert _stored(store, "job-quiet", "stdout") == [(0, "first"), (1, "second")]


def test_a_collector_polls_where_a_metric_source_reads_its_own_file(
    tmp_path: Path, tds: str
) -> None:
    learner_dir(tmp_path, 0).mkdir(parents=True)
    plain = Collector("job-w", 0, tmp_path, tds)
    assert plain.watched_files() == [
        learner_dir(tmp_path, 0) / "stdout.log",
        learner_dir(tmp_path, 0) / "stderr.log",
    ]
    with_file = Collector("job-w", 0, tmp_path, tds, metric_sources={"type": "emetrics_file"})
    assert with_file.watched_files() is None
    plain.stop(drain=False)
    with_file.stop(drain=False)


def test_a_burst_is_shipped_when_the_learner_pauses_not_at_the_flush_interval(
    tmp_path: Path, store: MemoryStore, tds: str
) -> None:
    """A batch of BURST_LINES or more is sent as soon as nothing more is written; with the
    flush interval out of reach, only that rule ships it."""
    from learner.controller import collector as collector_module

    learner_dir(tmp_path, 0).mkdir(parents=True)
    c = Collector("job-burst", 0, tmp_path, tds, flush_interval_s=3600.0, verify_interval_s=0)
    if collector_module.FileWait.open(c.watched_files() or []) is None:
        pytest.skip("no inotify here")
    c.start()
    burst = collector_module.BURST_LINES + 50
    _write(tmp_path, "stdout", "".join(f"line {i}\n" for i in range(burst)))
    _wait(lambda: len(_stored(store, "job-burst", "stdout")) == burst)
    assert c.stop(drain=True)


class CountingStore(MemoryStore):
    """Counts the batches of lines it took."""

    batches = 0

    def write_logs(self, lines: Any) -> int:
        self.batches += 1
        return super().write_logs(lines)


def test_offsets_are_written_at_most_every_commit_interval_and_at_the_end(
    tmp_path: Path,
) -> None:
    # A learner printing a line every 20 ms, shipped in a batch every 50 ms: each batch's
    # acknowledgement used to write (and fsync) the offsets file; now the acknowledged
    # position goes to the file at most once a second while lines keep coming, and at
    # once when the collector stops: with a drain, and without one too.
    store = CountingStore()
    d = learner_dir(tmp_path, 0)
    d.mkdir(parents=True)
    (d / "stderr.log").touch()
    with tds_in_process(store) as (tds, _):
        c = Collector(
            "commits", 0, tmp_path, tds, flush_interval_s=0.05, commit_interval_s=1.0
        ).start()
        started = time.monotonic()
        for i in range(100):
            _write(tmp_path, "stdout", f"line {i}\n")
            time.sleep(0.02)
        took = time.monotonic() - started
        _wait(lambda: len(_stored(store, "commits", "stdout")) == 100)
        running = c.commits
        assert store.batches >= 10, store.batches
        assert running <= took / 1.0 + 2, (running, store.batches, took)
        assert c.stop(drain=True)
    offsets = json.loads((d / OFFSETS_FILE).read_text())
    assert offsets["streams"]["stdout"]["seq"] == 100

    # Stopped without a drain: what was acknowledged is in the file all the same.
    _write(tmp_path, "stdout", "".join(f"more {i}\n" for i in range(5)))
    with tds_in_process(MemoryStore()) as (tds, _):
        c = Collector("commits", 0, tmp_path, tds, flush_interval_s=0.05, commit_interval_s=60)
        c.start()
        _wait(lambda: c.sent_lines == 5)
        c.stop(drain=False)
    assert json.loads((d / OFFSETS_FILE).read_text())["streams"]["stdout"]["seq"] == 105
