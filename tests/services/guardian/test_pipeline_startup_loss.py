"""A pipeline learner lost before the pipeline formed is restarted in place.

Real etcd and MongoDB-wire server, a guardian process, the local backend and the
pipeline runtime's float64 toy. Found under the p3 trace (benchmarks/pipeline_trace.py):
a hit on a learner that was still starting after a restart from the checkpoint left the
other worker waiting for it to register, and after 120 s the job FAILED with exit 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.store import states
from tests.services.guardian.helpers import pipeline_job

pytestmark = pytest.mark.integration


def test_a_worker_killed_before_the_pipeline_formed_restarts_in_place(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    # learner 1's first incarnation is SIGKILLed before its worker registers
    command = (
        'if [ "$RHIZOME_RANK" = 1 ] && [ ! -e ../rank1-killed ]; then '
        "touch ../rank1-killed; kill -9 $$; fi; exec python train.py --steps 6"
    )
    with pipeline_job(stores, tmp_path, command) as run:
        record = run.end(timeout_s=240)
    messages = [h.message for h in record.history]
    assert record.status == states.COMPLETED, run.explain()
    assert (
        "learner 1 lost before the pipeline formed (exit 137); restarted in place, the "
        "others wait for it to register (restart 1 of at most 2)"
    ) in messages, messages
    statuses = [h.status for h in record.history]
    assert "RECOVERING" not in statuses, messages  # no checkpoint restart: nothing formed
    assert not any("now served by" in m for m in messages), messages  # no failover either
    err1 = (run.learners_dir / "1" / "stderr.log").read_text()
    assert err1.count("started: stage 1 of pipeline 0") == 1, err1
    assert "finished: 6 steps, blocks [1] of pipeline 0, generation 0" in err1, err1
