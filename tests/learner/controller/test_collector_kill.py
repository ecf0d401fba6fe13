"""Chaos: kill the collector mid-stream, then the TDS, then restart the search server.

The indexed lines must equal the learner's own output exactly: no gap, no duplicate, in
order. Everything is real: a learner process printing to its log files, the collector
process, the TDS process (`python -m services.tds`) and the Elasticsearch-API server.
The search server is restarted gracefully: noida-db, the embedded stand-in, persists its
data only when it shuts down cleanly (a SIGKILL loses everything since its start, which a
real Elasticsearch with its translog would not), and even then it drops bulk writes that
race its shutdown after acknowledging them. That is what made this test fail now and then:
the collector now checks what the store holds (`CountStored`) and resends what is missing.
`benchmarks/log_kill_soak.py` runs the sequence many times, with and without the checks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from rhizome.v1 import tds_pb2

from contract.env import learner_dir
from contract.procs import free_port, stop_process_group
from learner.controller.collector import OFFSETS_FILE
from services.embedded.servers import ElasticsearchServer
from tests.services.tds.helpers import REPO, TDSProcess, stub

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N_LINES = 3000
# The learner prints in four phases and waits for the test between them, so that every
# crash happens while it still has lines to print (no timing luck involved).
WRITER = f"""
import os, sys, time
for i in range({N_LINES}):
    if i % 750 == 0 and i:
        while not os.path.exists(f"go{{i // 750}}"):
            time.sleep(0.01)
    print(f"out {{i}} loss={{1 / (i + 1):.6f}} ünïcode", flush=True)
    if i % 10 == 0:
        print(f"err {{i}}", file=sys.stderr, flush=True)
    if i % 20 == 0:
        time.sleep(0.005)
"""


def _committed(job_dir: Path) -> int:
    try:
        st = json.loads((learner_dir(job_dir, 0) / OFFSETS_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return 0
    return int(st["streams"]["stdout"]["seq"])


def _wait(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _collector(job_dir: Path, tds: str, log: Path, verify_s: float) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "learner.controller.collector", "--job-id", "kill-job",
             "--learner", "0", "--job-dir", str(job_dir), "--tds", tds,
             "--batch-lines", "100", "--flush-interval-s", "0.05",
             "--verify-interval-s", str(verify_s)],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


@dataclass
class KillRun:
    """What one kill sequence left: the learner's own lines and what the TDS returns."""

    own: dict[str, list[str]]
    stored: dict[str, list[tuple[int, str]]]
    resends: int  # times the collector found the store short and sent lines again

    def expected(self, stream: str) -> list[tuple[int, str]]:
        return list(enumerate(self.own[stream]))


def kill_sequence(tmp_path: Path, verify_s: float = 5.0) -> KillRun:
    """Kill the collector, then the TDS, then restart the search server, while a learner
    prints; return what was printed and what was stored (`benchmarks/log_kill_soak.py`
    repeats this many times). verify_s <= 0 turns the collector's checks off."""
    es = ElasticsearchServer(tmp_path / "es")
    es.start()
    tds = TDSProcess(es.url, free_port(), tmp_path / "tds.log")
    procs: list[subprocess.Popen[bytes]] = []
    job_dir = tmp_path / "job"
    ldir = learner_dir(job_dir, 0)
    ldir.mkdir(parents=True)
    collector_log = tmp_path / "collector.log"
    try:
        tds.start()
        with open(ldir / "stdout.log", "ab") as out, open(ldir / "stderr.log", "ab") as err:
            writer = subprocess.Popen(
                [sys.executable, "-u", "-c", WRITER], stdout=out, stderr=err,
                cwd=job_dir, start_new_session=True,
            )  # fmt: skip
        procs.append(writer)
        collector = _collector(job_dir, tds.address, collector_log, verify_s)
        procs.append(collector)

        _wait(lambda: _committed(job_dir) > 300, "the first batches")
        collector.send_signal(signal.SIGKILL)
        collector.wait(10)
        collector = _collector(job_dir, tds.address, collector_log, verify_s)
        procs.append(collector)
        (job_dir / "go1").touch()

        _wait(lambda: _committed(job_dir) > 1000, "batches after the collector restart")
        tds.kill()
        time.sleep(0.5)
        tds.start()
        (job_dir / "go2").touch()

        # The search server stops while batches are still arriving: noida-db acknowledges
        # some writes that race its shutdown and then does not keep them.
        _wait(lambda: _committed(job_dir) > 1700, "batches after the TDS restart")
        es.stop()
        time.sleep(0.5)
        es = ElasticsearchServer(tmp_path / "es", port=es.port)
        es.start()
        (job_dir / "go3").touch()

        assert writer.wait(120) == 0
        collector.send_signal(signal.SIGTERM)  # drain and exit
        assert collector.wait(120) == 0, collector_log.read_text()

        channel, s = stub(tds.address)
        got = list(s.GetLogs(tds_pb2.LogsRequest(job_id="kill-job", learner=-1)))
        channel.close()
    finally:
        for p in procs:
            if p.poll() is None:
                stop_process_group(p.pid)
        tds.stop()
        es.stop()

    stored: dict[str, list[tuple[int, str]]] = {"stdout": [], "stderr": []}
    for ln in got:
        stored[ln.stream].append((ln.seq, ln.line))
    own = {s: (ldir / f"{s}.log").read_text().splitlines() for s in ("stdout", "stderr")}
    resends = collector_log.read_text().count("sending them again")
    return KillRun(own, stored, resends)


def test_no_line_lost_or_duplicated_across_collector_tds_and_es_restarts(tmp_path: Path) -> None:
    run = kill_sequence(tmp_path)
    assert len(run.own["stdout"]) == N_LINES
    assert run.stored["stdout"] == run.expected("stdout")
    assert run.stored["stderr"] == run.expected("stderr")
