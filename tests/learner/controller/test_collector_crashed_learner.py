"""A crashed learner's last lines are searchable, after its job directory is gone too."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
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

CRASHER = """
import sys
for i in range(100):
    print(f"step {i}")
sys.stdout.write("half a line, then the crash")
sys.stdout.flush()
raise RuntimeError("CUDA out of memory (simulated)")
"""


def test_last_lines_of_a_crashed_learner_outlive_its_teardown(
    es_server: ManagedServer, tmp_path: Path
) -> None:
    job = f"crash-{uuid.uuid4().hex[:6]}"
    store = ElasticsearchStore(es_server.url, prefix=f"c{uuid.uuid4().hex[:6]}")
    job_dir = tmp_path / "job"
    ldir = learner_dir(job_dir, 0)
    ldir.mkdir(parents=True)
    with tds_in_process(store) as (addr, _):
        collector = Collector(job, 0, job_dir, addr).start()
        with open(ldir / "stdout.log", "ab") as out, open(ldir / "stderr.log", "ab") as err:
            rc = subprocess.run([sys.executable, "-c", CRASHER], stdout=out, stderr=err).returncode
        assert rc == 1
        assert collector.stop(drain=True)
        shutil.rmtree(job_dir)  # the job's teardown
        channel, s = stub(addr)
        # Acknowledged lines become searchable within the index's refresh interval.
        deadline = time.monotonic() + 10
        while True:
            last = list(s.GetLogs(tds_pb2.LogsRequest(job_id=job, learner=0, pos=-10)))
            if len(last) == 10 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        errors = list(s.GetLogs(tds_pb2.LogsRequest(job_id=job, learner=-1, search="memory")))
        channel.close()
    store.close()
    outs = [ln.line for ln in last if ln.stream == "stdout"]
    assert outs[-1] == "half a line, then the crash"
    assert [ln.line for ln in errors] == ["RuntimeError: CUDA out of memory (simulated)"]
