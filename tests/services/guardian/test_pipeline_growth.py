"""A pipeline job grown by a whole pipeline from its standbys, then a loss in the new one.

Real etcd and MongoDB-wire server, a guardian process, the local backend and the
pipeline runtime's float64 toy (`pipeline: {stages: 2, pipelines: 1, standbys: 2,
max_pipelines: 2}`: workers 0 and 1, standbys 2 and 3 queued from the start).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from services.store import states
from tests.integration.test_pipeline_jobs import worker_pids
from tests.learner.runtime.test_growth import assert_equals_grown_reference
from tests.services.guardian.helpers import pipeline_job

pytestmark = pytest.mark.integration


@pytest.mark.timeout(900)  # the waits below end first, saying what the job looked like
def test_a_grown_pipeline_loses_a_learner_and_its_replacement_takes_the_slot_back(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    """Both standbys queue, nothing is lost: they grow the job to two pipelines
    (generation 1; learners 2 and 3 take slots 2 and 3), which the guardian writes into
    the history from the runtime's state. Learner 3 (stage 1 of the new pipeline) is
    then SIGKILLed → the runtime fails over to its shadow, learner 2 (generation 2), the
    guardian records the preemption and starts a replacement for rank 3, which takes
    slot 3 back (generation 3). COMPLETED without a restart, the four slots' parameters
    equal the reference grown at the same step. The toy's gates order the events: step 5
    waits for the growth, step 15 for the replacement's admission."""
    steps = 30
    with pipeline_job(
        stores,
        tmp_path,
        f"python train.py --steps {steps} --gate 5:1,15:3",
        pipeline={"stages": 2, "pipelines": 1, "standbys": 2, "max_pipelines": 2},
    ) as run:
        job, explain = run.job, run.explain
        run.wait(
            "the growth: learner 3 serves slot 3",
            lambda: run.logged(3, "[worker 3] joined generation 1"),
        )
        victims = worker_pids(job.job_id, 3)
        assert victims, "learner 3's worker is not running\n" + explain()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        record = run.end()
        err2 = (run.learners_dir / "2" / "stderr.log").read_text()
    messages = [h.message for h in record.history]
    statuses = [h.status for h in record.history]
    assert record.status == states.COMPLETED, explain()
    assert "RECOVERING" not in statuses and statuses.count("DEPLOYING") == 1, messages

    def index(message: str) -> int:
        found = [i for i, m in enumerate(messages) if m == message]
        assert len(found) == 1, f"{message!r} once in:\n" + "\n".join(messages)
        return found[0]

    grown = index(
        "pipeline grown to 2 pipelines: learners 2, 3 took slots 2, 3 (stages 0..1 of "
        "pipeline 1) from the queued standbys, without a cold start (generation 1)"
    )
    loss = index("learner 3 preempted; stage 1 now served by learner 2 (generation 2)")
    replaced = index(
        "learner 3 lost: a replacement joins as a standby (replacement 1 of at most 2)"
    )
    back = index(
        "learner 3 replaced: stage 1 served by its own learner again, every block has a "
        "replica (generation 3)"
    )
    assert grown < loss < replaced < back, messages
    assert sum(" preempted" in m for m in messages) == 1, messages
    found = re.search(
        r"joined generation 1 .*\(reconfiguration\).* step (\d+) from its start", err2
    )
    assert found, err2
    results = tmp_path / "objects" / "results" / job.job_id
    saved = sorted(f"{f.parent.name}/{f.name}" for f in results.glob("*/worker*.pt"))
    assert saved == [f"{w}/worker{w}.pt" for w in range(4)], saved
    params = tmp_path / "params"
    params.mkdir()
    for f in results.glob("*/worker*.pt"):
        shutil.copy(f, params / f.name)
    assert_equals_grown_reference(params, steps, int(found.group(1)))
