"""Growth by a whole pipeline (D+1, Bamboo §4.3) from queued standbys.

Through the launcher with the real etcd: P=2 × D=1 with two standbys whose tickets allow
two pipelines — both queue, the job grows to D=2 at a step boundary, the standbys receive
their blocks (and replicas) with optimizer state from pipeline 0 and train as pipeline 1;
the four workers end with equal parameters, equal to the single-process reference that
adds the second pipeline's microbatches from the growth step on. After a growth a loss in
the new pipeline fails over as before. The admission rules (no growth while a slot is
dead, none beyond ``max_pipelines``, stale and used tickets) run against the real etcd.
"""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from learner.runtime.reference import reference_train
from learner.runtime.toy import toy_job
from services.embedded.process import ManagedServer
from tests.learner.runtime.test_failover import REPO, TOY, saved_params

pytestmark = pytest.mark.integration


def grow_argv(etcd: ManagedServer, out: Path, steps: int, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "learner.runtime.launch",
        "--stages",
        "2",
        "--pipelines",
        "1",
        "--standbys",
        "2",
        "--max-pipelines",
        "2",
        "--etcd",
        etcd.url,
        "--job-id",
        f"t-{uuid.uuid4().hex[:10]}",
        # the gate holds step 4 until the growth (standbys need seconds to start)
        "--detection-timeout",
        "300",
        "--out-dir",
        str(out),
        *extra,
        str(TOY),
        "--steps",
        str(steps),
        "--gate",
        "4:1",
    ]


def growth_step(err: str) -> int:
    """The step the grown job restarted from (every worker joins generation 1 there)."""
    found = re.search(
        r"\[worker 2\] joined generation 1 .*\(reconfiguration\): owns blocks \[0\], "
        r"replica 1, step (\d+) from its start",
        err,
    )
    assert found, err[-4000:]
    return int(found.group(1))


def assert_equals_grown_reference(out: Path, steps: int, grew: int) -> None:
    # saved_params asserts that every pipeline's copy of a block is identical (bitwise)
    got = saved_params(out)
    ref = reference_train(toy_job(steps=steps), 1, grow_at={grew: 2})
    assert set(got) == set(ref)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-9, atol=1e-11, msg=key)
    # and it differs from never growing: the test can tell a growth happened
    never = reference_train(toy_job(steps=steps), 1)
    assert any(not torch.allclose(got[k], never[k]) for k in ref)


def test_two_standbys_grow_the_job_by_a_pipeline_and_it_trains_on(
    etcd_server: ManagedServer, tmp_path: Path
) -> None:
    out, steps = tmp_path / "params", 10
    proc = subprocess.run(
        grow_argv(etcd_server, out, steps, []),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    err = proc.stderr
    assert proc.returncode == 0, err[-4000:]
    assert re.search(r"standby [23]: grew the job to 2 pipelines, standbys \[2, 3\]", err), err
    grew = growth_step(err)
    assert 0 <= grew <= 4
    # the new pipeline's workers get block and replica, parameters and optimizer state,
    # from their owners in pipeline 0
    assert f"[worker 2] received block 0 at version {grew} from worker 0" in err
    assert f"[worker 2] received block 1 (replica) at version {grew} from worker 1" in err
    assert f"[worker 3] received block 1 at version {grew} from worker 1" in err
    assert f"[worker 3] received block 0 (replica) at version {grew} from worker 0" in err
    for worker in range(4):
        stage, pipeline = worker % 2, worker // 2
        assert (
            f"[worker {worker}] finished: {steps} steps, blocks [{stage}] of pipeline "
            f"{pipeline}, generation 1" in err
        ), err[-4000:]
    assert sorted(p.name for p in out.iterdir()) == [f"worker{w}.pt" for w in range(4)]
    assert_equals_grown_reference(out, steps, grew)
