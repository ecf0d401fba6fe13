"""A pipeline learner's controller dies after the pipeline formed.

Real etcd and MongoDB-wire server, a guardian process, the local backend and the
pipeline runtime's float64 toy. A controller's death is the platform's failure, not the
job's: the guardian starts a new controller for the rank. Before the fix, a worker that
went with its controller came back as a plain worker of generation 0 (no admission
ticket) — or a replacement's controller was restarted as the first incarnation, which
ran the command again — and the runtime refused it (`job already at generation N`): the
job FAILED.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from contract import procs
from contract.env import Role
from services.store import states
from tests.integration.test_pipeline_jobs import worker_pids
from tests.learner.runtime.test_failover import assert_equals_reference
from tests.services.guardian.helpers import PipelineRun, pipeline_job

pytestmark = pytest.mark.integration

STEPS = 60


def kill_controller(run: PipelineRun, rank: int, with_worker: bool) -> None:
    """SIGKILL learner `rank`'s controller (and, `with_worker`, its worker with it, as a
    node or a container going away takes both)."""
    controllers = procs.labelled(run.job.job_id, rank, Role.CONTROLLER)
    workers = worker_pids(run.job.job_id, rank)
    assert controllers and workers, f"learner {rank} is not running\n" + run.explain()
    for pid in controllers + (workers if with_worker else []):
        os.kill(pid, signal.SIGKILL)


def assert_final_parameters(run: PipelineRun, tmp_path: Path) -> None:
    results = run.data_dir / "objects" / "results" / run.job.job_id
    saved = sorted(f"{f.parent.name}/{f.name}" for f in results.glob("*/worker*.pt"))
    assert saved == ["0/worker0.pt", "1/worker1.pt"], saved
    params = tmp_path / "params"
    params.mkdir()
    for f in results.glob("*/worker*.pt"):
        shutil.copy(f, params / f.name)
    assert_equals_reference(params, pipelines=1, steps=STEPS)


@pytest.mark.timeout(600)  # the waits end first, saying what the job looked like
def test_a_controller_lost_with_its_worker_after_formation_comes_back_as_a_replacement(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    """Learner 1's controller and worker are SIGKILLed together at step 5 → the runtime
    fails over to learner 0 → learner 1 returns through the replacement path (a fresh
    ticket, joins as a standby, takes its slot back; step 30 waits for that) → then its
    (replacement's) controller alone is SIGKILLed (step 45 waits for that): the new controller re-adopts the
    running worker (same incarnation, same ticket), nothing runs twice → COMPLETED with
    the parameters of the uninterrupted run."""
    # Step 45 waits for <job dir>/release, made once the second kill is done: on a loaded
    # machine the last 30 steps could otherwise end the job before that kill.
    command = f"python train.py --steps {STEPS} --gate 30:2 --hold 45:../release"
    with pipeline_job(stores, tmp_path, command) as run:
        run.formed()
        run.wait("step 5 on learner 1", lambda: run.logged(1, "step 5 ", "stdout.log"))
        kill_controller(run, 1, with_worker=True)
        run.wait(
            "learner 1's replacement to join",
            lambda: run.logged(1, "[worker 1] joined generation 2"),
        )
        kill_controller(run, 1, with_worker=False)
        (run.data_dir / "jobs" / run.job.job_id / "release").touch()
        record = run.end()
    messages = [h.message for h in record.history]
    assert record.status == states.COMPLETED, run.explain()
    expected = [
        "learner 1 preempted; stage 1 now served by learner 0 (generation 1)",
        "learner 1 lost: a replacement joins as a standby (replacement 1 of at most 2)",
        "learner 1 replaced: stage 1 served by its own learner again, every block has a "
        "replica (generation 2)",
    ]
    assert [m for m in messages if m in expected] == expected, messages
    assert sum(" preempted" in m for m in messages) == 1, messages
    # the replacement's controller was restarted as the replacement (incarnation 1)
    assert (
        "learner 1's controller died after the pipeline formed; a new controller of the same "
        "incarnation (1) re-adopts its worker, or reports it gone (then the runtime fails over "
        "and a replacement joins)"
    ) in messages, messages
    assert "RECOVERING" not in [h.status for h in record.history], messages
    err1 = (run.learners_dir / "1" / "stderr.log").read_text()
    assert "already at generation" not in err1, err1
    # the first worker and its replacement, each once: the re-adopted one not again
    assert err1.count("[worker 1] started:") == 1, err1
    assert err1.count("[worker 1] joined generation 2") == 1, err1
    assert f"[worker 1] finished: {STEPS} steps, blocks [1] of pipeline 0" in err1, err1
    assert_final_parameters(run, tmp_path)


@pytest.mark.timeout(600)
def test_a_controller_lost_alone_after_formation_re_adopts_its_worker(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    """Learner 1's controller alone is SIGKILLed at step 5: its worker goes on, the new
    controller re-adopts it, the runtime sees no loss → COMPLETED, no failover, the
    worker started once, the parameters of the uninterrupted run."""
    with pipeline_job(stores, tmp_path, f"python train.py --steps {STEPS}") as run:
        run.formed()
        run.wait("step 5 on learner 1", lambda: run.logged(1, "step 5 ", "stdout.log"))
        kill_controller(run, 1, with_worker=False)
        record = run.end()
    messages = [h.message for h in record.history]
    assert record.status == states.COMPLETED, run.explain()
    assert not any(" preempted" in m or m.startswith("learner 1 lost") for m in messages), messages
    assert (
        "learner 1's controller died after the pipeline formed; a new controller of the same "
        "incarnation (0) re-adopts its worker, or reports it gone (then the runtime fails over "
        "and a replacement joins)"
    ) in messages, messages
    err1 = (run.learners_dir / "1" / "stderr.log").read_text()
    assert err1.count("[worker 1] started:") == 1, err1
    assert f"[worker 1] finished: {STEPS} steps, blocks [1] of pipeline 0, generation 0" in err1
    assert_final_parameters(run, tmp_path)
