"""A second loss while redundancy is still being restored, survived with a standby.

Real etcd and MongoDB-wire server, a guardian process, the local backend and the
pipeline runtime's float64 toy (`pipeline: {stages: 2, pipelines: 1, standbys: 2}`:
workers 0 and 1, standbys 2 and 3 queued from the start).
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
from tests.learner.runtime.test_failover import assert_equals_reference
from tests.services.guardian.helpers import pipeline_job

pytestmark = pytest.mark.integration


@pytest.mark.timeout(900)  # the waits below end first, saying what the job looked like
def test_a_standby_that_took_a_slot_is_lost_and_the_next_standby_takes_it(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    """Learner 1 is SIGKILLed once the pipeline formed and both standbys are queued (on a
    loaded machine a standby could otherwise still be starting, and learner 1's own
    replacement would take its slot back first) → a waiting standby (W) takes slot 1
    (generation 2) while
    learner 1 restarts, cold, as the next standby → W is SIGKILLed at step 20, the same
    block lost again before that restart has joined → the runtime fails over to learner 0
    (the shadow) and the other queued standby takes slot 1 (generation 4): every block
    has a replica again, never a fatal loss. The guardian follows the slot, not the rank:
    the history names the slot W served, its replacement, and who took over. COMPLETED,
    with the parameters of the uninterrupted run. The toy's gates order the events: step
    15 waits for W's admission, step 20 for the second failover (so W dies with the
    others waiting at step 20), step 40 for the second admission. Every wait that times out
    prints the job's history and its learners' and guardian's last lines."""
    steps = 60
    took = re.compile(
        r"standby learner (\d) took over stage 1 of pipeline 0 \(learner 1's slot\) without a "
        r"cold start, every block has a replica \(generation 2\)"
    )
    with pipeline_job(
        stores,
        tmp_path,
        f"python train.py --steps {steps} --gate 15:2,20:3,40:4",
        # the workers; the record holds 4 learners (the standbys too)
        pipeline={"stages": 2, "pipelines": 1, "standbys": 2},
    ) as run:
        job, explain, logged = run.job, run.explain, run.logged
        # formed (a loss before would restart learner 1 in place, no failover) and both
        # standbys waiting; the gate holds the workers at step 15 meanwhile
        run.wait(
            "the pipeline formed and both standbys queued",
            lambda: (
                all(logged(r, f"[worker {r}] started:") for r in (0, 1))
                and all(logged(r, f"standby {r}: queued") for r in (2, 3))
            ),
        )
        first_victims = worker_pids(job.job_id, 1)
        assert first_victims, "learner 1's worker is not running\n" + explain()
        for pid in first_victims:
            os.kill(pid, signal.SIGKILL)

        def admitted() -> re.Match[str] | None:
            record = run.repo.get(job.job_id)
            assert record.status not in states.TERMINAL_STATES, "ended early\n" + explain()
            return next((m for h in record.history if (m := took.fullmatch(h.message))), None)

        first = run.wait("a standby's admission into slot 1 in the history", admitted)
        holder = int(first.group(1))
        # W has finished re-forming (it holds block 1), the others wait at step 20
        run.wait(
            f"learner {holder} to hold slot 1",
            lambda: logged(holder, "[worker 1] joined generation 2"),
            60,
        )
        victims = worker_pids(job.job_id, holder)
        assert victims, f"learner {holder}'s worker is not running\n" + explain()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        record = run.end()
    messages = [h.message for h in record.history]
    statuses = [h.status for h in record.history]
    assert record.status == states.COMPLETED, run.explain()
    assert "RECOVERING" not in statuses and statuses.count("DEPLOYING") == 1, messages

    def index(pattern: str) -> int:
        found = [i for i, m in enumerate(messages) if re.fullmatch(pattern, m)]
        assert len(found) == 1, f"{pattern} in:\n" + "\n".join(messages)
        return found[0]

    first_loss = index(
        re.escape("learner 1 preempted; stage 1 now served by learner 0 (generation 1)")
    )
    first_standby = index(took.pattern.replace("(\\d)", str(holder)))
    second_loss = index(
        re.escape(
            f"learner {holder} preempted (it served stage 1 of pipeline 0, learner 1's slot); "
            "stage 1 now served by learner 0 (generation 3)"
        )
    )
    # the other standby queued from the start, or learner 1's replacement if it had
    # finished starting by then: either way a waiting standby, no cold start
    other = 5 - holder  # standbys are learners 2 and 3
    second_standby = index(
        rf"(standby learner {other} took over stage 1 of pipeline 0 \(learner 1's slot\) "
        r"without a cold start|learner 1 replaced: stage 1 served by its own learner again), "
        r"every block has a replica \(generation 4\)"
    )
    replaced = index(
        re.escape(
            f"learner {holder} lost: a replacement joins as a standby (replacement 1 of at most 2)"
        )
    )
    # What is ordered by cause: W is killed after its admission is in the history, and
    # its replacement is issued after its loss is. A standby's admission may be in the
    # history before the loss it followed: the guardian sees the admission (a
    # compare-and-set within milliseconds) before the lost learner's controller has
    # written FAILED; the generations in the lines give their real order.
    assert first_loss < second_loss and first_standby < second_loss, messages
    assert second_loss < replaced and first_standby < second_standby, messages
    assert not any("fatal" in m for m in messages), messages
    # two preemptions (learner 1 and W); standbys refused at the end are none
    assert sum(" preempted" in m for m in messages) == 2, messages
    # the slots' final holders saved the blocks: together, the uninterrupted run's
    results = tmp_path / "objects" / "results" / job.job_id
    saved = sorted(f"{f.parent.name}/{f.name}" for f in results.glob("*/worker*.pt"))
    final = other if f"standby learner {other}" in messages[second_standby] else 1
    assert saved == ["0/worker0.pt", f"{final}/worker1.pt"], saved
    params = tmp_path / "params"
    params.mkdir()
    for f in results.glob("*/worker*.pt"):
        shutil.copy(f, params / f.name)
    assert_equals_reference(params, pipelines=1, steps=steps)
