"""Pipelined batches (issue #18): the collector sends the next batches while an earlier
one is unacknowledged, yet commits offsets only in order. A batch the store fails while
later ones were stored is sent again, and the committed position never passes it.
In-process TDS over real gRPC, backed by the in-memory store."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from rhizome.v1 import tds_pb2

from learner.controller.collector import (
    BUSY_VERIFY_FACTOR,
    OFFSETS_FILE,
    Collector,
    learner_dir,
)
from services.tds.api import Query, StoreUnavailable
from services.tds.memory_store import MemoryStore
from tests.services.tds.helpers import tds_in_process


class FirstBatchHeldThenLost(MemoryStore):
    """Holds the batch that starts at seq 0 until released, then fails it (UNAVAILABLE)
    once; every other batch is stored at once."""

    def __init__(self) -> None:
        super().__init__()
        self.held = threading.Event()
        self.release = threading.Event()
        self.failed = False

    def write_logs(self, lines: Sequence[tds_pb2.LogLine]) -> int:
        if not self.failed and lines and lines[0].seq == 0:
            self.failed = True
            self.held.set()
            self.release.wait(30)
            raise StoreUnavailable("the search server lost this bulk request")
        return super().write_logs(lines)


def _committed_seq(job_dir: Path) -> int:
    path = learner_dir(job_dir, 0) / OFFSETS_FILE
    if not path.exists():
        return 0
    return int(json.loads(path.read_text())["streams"]["stdout"]["seq"])


def _wait(cond: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.02)
    assert cond(), "condition not reached"  # type: ignore[operator]


def test_later_batches_go_ahead_but_offsets_wait_for_the_lost_one(tmp_path: Path) -> None:
    store = FirstBatchHeldThenLost()
    d = learner_dir(tmp_path, 0)
    d.mkdir(parents=True)
    (d / "stdout.log").write_text("".join(f"line {i}\n" for i in range(30)))
    (d / "stderr.log").touch()
    with tds_in_process(store) as (tds, _):
        c = Collector("pipe", 0, tmp_path, tds, batch_lines=10, max_in_flight=3).start()
        try:
            _wait(store.held.is_set)

            def later_stored() -> bool:
                seqs = {ln.seq for ln in store.query_logs(Query("pipe"))}
                return set(range(10, 30)) <= seqs

            # Batches 2 and 3 were sent and stored while batch 1 was unacknowledged...
            _wait(later_stored)
            # ...but nothing is committed past the batch still outstanding.
            assert _committed_seq(tmp_path) == 0
            store.release.set()
            assert c.stop(drain=True)
        finally:
            store.release.set()
    stored = sorted((ln.seq, ln.line) for ln in store.query_logs(Query("pipe")))
    assert stored == [(i, f"line {i}") for i in range(30)]
    assert _committed_seq(tmp_path) == 30
    assert c.sent_lines == 30


def test_the_store_check_waits_for_a_quiet_moment_but_not_for_ever(tmp_path: Path) -> None:
    # A check settles the pipeline and costs the server a refresh and a count: under a
    # burst it waits for a moment with nothing new to read, up to BUSY_VERIFY_FACTOR
    # intervals.
    d = learner_dir(tmp_path, 0)
    d.mkdir(parents=True)
    (d / "stdout.log").write_text("a\nb\n")
    (d / "stderr.log").touch()
    with tds_in_process(MemoryStore()) as (tds, _):
        c = Collector("quiet", 0, tmp_path, tds, verify_interval_s=5.0)
        c.collect()
        c.flush()  # acknowledged, not yet verified
        c._last_verify = time.monotonic() - 6.0
        assert not c._verify_due(idle=False)
        assert c._verify_due(idle=True)
        c._last_verify = time.monotonic() - 5.0 * BUSY_VERIFY_FACTOR - 1.0
        assert c._verify_due(idle=False)
        c.stop(drain=False)
