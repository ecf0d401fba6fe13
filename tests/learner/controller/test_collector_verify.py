"""The collector checks that the store kept what it acknowledged, and resends what it lost.

A search server can lose writes it acknowledged (the embedded noida-db drops bulk writes
that race its shutdown). These tests make the in-memory store forget acknowledged records
and check that the collector notices (`CountStored`) and sends them again, exactly once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from rhizome.v1 import tds_pb2

from contract.env import learner_dir
from learner.controller.collector import OFFSETS_FILE, Collector
from services.tds.api import Query, StoreRejected
from services.tds.memory_store import MemoryStore
from tests.learner.controller.test_collector import _wait
from tests.services.tds.helpers import tds_in_process


class RefusingStore(MemoryStore):
    """Refuses every batch holding a line with 'poison' in it (a 4xx from the search server)."""

    def write_logs(self, lines: Sequence[tds_pb2.LogLine]) -> int:
        if any("poison" in ln.line for ln in lines):
            raise StoreRejected("mapping conflict (test)")
        return super().write_logs(lines)


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def tds(store: MemoryStore) -> Iterator[str]:
    with tds_in_process(store) as (addr, _):
        yield addr


def _write(job_dir: Path, text: str) -> None:
    d = learner_dir(job_dir, 0)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "stdout.log", "a") as f:
        f.write(text)


def _stored(store: MemoryStore, job: str) -> list[tuple[int, str]]:
    return [(ln.seq, ln.line) for ln in store.query_logs(Query(job)) if ln.stream == "stdout"]


def _forget(store: MemoryStore, job: str, seqs: range) -> None:
    """Drop acknowledged lines and metric samples, as a search server losing writes would."""
    with store._lock:
        logs = store._logs[job]
        for doc_id in [k for k, ln in logs.items() if ln.seq in seqs]:
            del logs[doc_id]
        metrics = store._metrics.get(job, {})
        for doc_id in [k for k, s in metrics.items() if s.seq in seqs]:
            del metrics[doc_id]


def test_lines_lost_after_their_ack_are_sent_again_before_the_collector_exits(
    tmp_path: Path, store: MemoryStore, tds: str
) -> None:
    regex = {"type": "regex_extractor", "regex": r"line (?P<step>\d+) loss=(?P<loss>[\d.]+)"}
    _write(tmp_path, "".join(f"line {i} loss={i / 10}\n" for i in range(20)))
    c = Collector("job-v1", 0, tmp_path, tds, metric_sources=regex, verify_interval_s=3600)
    c.start()
    _wait(lambda: len(_stored(store, "job-v1")) == 20)
    _forget(store, "job-v1", range(5, 12))  # acknowledged, then lost
    _write(tmp_path, "".join(f"line {i} loss={i / 10}\n" for i in range(20, 25)))
    assert c.stop(drain=True)
    assert c.rewinds == 1
    assert _stored(store, "job-v1") == [(i, f"line {i} loss={i / 10}") for i in range(25)]
    samples = sorted((m.seq, m.step) for m in store.query_metrics(Query("job-v1")))
    assert samples == [(i, i) for i in range(25)]
    offsets = json.loads((learner_dir(tmp_path, 0) / OFFSETS_FILE).read_text())
    assert offsets["verified"]["streams"]["stdout"]["seq"] == 25  # all of it checked


def test_the_periodic_check_refills_a_gap_while_the_learner_runs(
    tmp_path: Path, store: MemoryStore, tds: str
) -> None:
    _write(tmp_path, "".join(f"a{i}\n" for i in range(30)))
    c = Collector("job-v2", 0, tmp_path, tds, verify_interval_s=3600, poll_interval_s=0.02)
    c.start()
    try:
        _wait(lambda: len(_stored(store, "job-v2")) == 30)
        _forget(store, "job-v2", range(0, 30))
        # Lost before any check ran. No new line is written: the next periodic check alone
        # must notice and resend.
        c.verify_interval_s = 0.1
        _wait(lambda: len(_stored(store, "job-v2")) == 30)
        assert c.rewinds >= 1
    finally:
        assert c.stop(drain=True)
    assert _stored(store, "job-v2") == [(i, f"a{i}") for i in range(30)]


def test_a_restarted_collector_checks_what_its_predecessor_had_acknowledged(
    tmp_path: Path, store: MemoryStore, tds: str
) -> None:
    _write(tmp_path, "".join(f"b{i}\n" for i in range(10)))
    first = Collector("job-v3", 0, tmp_path, tds, verify_interval_s=3600).start()
    _wait(lambda: len(_stored(store, "job-v3")) == 10)
    first.stop(drain=False)  # as if killed: acknowledged, never checked
    _forget(store, "job-v3", range(3, 10))
    assert Collector("job-v3", 0, tmp_path, tds).start().stop(drain=True)
    assert _stored(store, "job-v3") == [(i, f"b{i}") for i in range(10)]


def test_a_window_the_store_keeps_refusing_is_given_up_after_bounded_resends(
    tmp_path: Path,
) -> None:
    store = RefusingStore()
    with tds_in_process(store) as (addr, _):
        _write(tmp_path, "ok 0\npoison\nok 2\n")
        c = Collector("job-v4", 0, tmp_path, addr, batch_lines=1, max_rewinds=2)
        assert c.start().stop(drain=True, timeout=30)
    assert c.rewinds == 2
    # The refused line is the only one missing; the collector did not loop for ever.
    assert _stored(store, "job-v4") == [(0, "ok 0"), (2, "ok 2")]
