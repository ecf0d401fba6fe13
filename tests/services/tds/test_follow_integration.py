"""`logs --follow` end to end: a learner printing, its collector, the TDS on the real
Elasticsearch-API server; the follower sees every line as it is printed, exactly once
and in order, and its stream returns once the job has ended."""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from rhizome.v1 import tds_pb2

from contract.env import learner_dir
from learner.controller.collector import Collector
from services.embedded.process import ManagedServer
from services.tds.es_store import ElasticsearchStore
from tests.services.tds.helpers import stub, tds_in_process

pytestmark = pytest.mark.integration

# After line 10 the learner waits until the follower has shown it: proof that lines
# reach a follower while the job runs, without any timing assumption.
PRINTER = """
import os, sys, time
for i in range(400):
    print(f"line {i}", flush=True)
    if i % 50 == 0:
        print(f"warn {i}", file=sys.stderr, flush=True)
    if i == 10:
        deadline = time.monotonic() + 60
        while not os.path.exists("seen"):
            if time.monotonic() > deadline:
                sys.exit(3)
            time.sleep(0.01)
"""


def test_follow_shows_lines_while_printed_and_returns_when_the_job_ends(
    es_server: ManagedServer, tmp_path: Path
) -> None:
    job = f"follow-{uuid.uuid4().hex[:6]}"
    finished = threading.Event()
    store = ElasticsearchStore(es_server.url, prefix=f"f{uuid.uuid4().hex[:6]}")
    with tds_in_process(
        store, lambda j: j == job and finished.is_set(), follow_poll_s=0.1, finish_grace_s=0.5
    ) as (addr, _):
        channel, s = stub(addr)
        got: list[tds_pb2.LogLine] = []
        seen_before_end = threading.Event()

        def follow() -> None:
            for ln in s.GetLogs(tds_pb2.LogsRequest(job_id=job, learner=-1, follow=True)):
                got.append(ln)
                if ln.line == "line 10" and not finished.is_set():
                    seen_before_end.set()
                    (tmp_path / "seen").touch()

        follower = threading.Thread(target=follow)
        follower.start()
        ldir = learner_dir(tmp_path, 0)
        ldir.mkdir(parents=True)
        collector = Collector(job, 0, tmp_path, addr).start()
        with (
            open(ldir / "stdout.log", "ab") as out_file,
            open(ldir / "stderr.log", "ab") as err_file,
        ):
            printer = subprocess.Popen(
                [sys.executable, "-c", PRINTER], stdout=out_file, stderr=err_file, cwd=tmp_path
            )
        assert printer.wait(90) == 0, "line 10 never reached the follower while printing"
        # What the learner controller does when the user command exits:
        assert collector.stop(drain=True)
        finished.set()
        follower.join(60)
        assert not follower.is_alive(), "follow did not return after the job ended"
        channel.close()
    store.close()
    assert seen_before_end.is_set(), "no line reached the follower while the learner ran"
    out = [ln.line for ln in got if ln.stream == "stdout"]
    err = [ln.line for ln in got if ln.stream == "stderr"]
    assert out == [f"line {i}" for i in range(400)]
    assert err == [f"warn {i}" for i in range(0, 400, 50)]
