"""Chaos, separately: a guardian SIGKILLed in the middle of a deploy. The next guardian
finds the steps recorded without `complete`, rolls back everything labelled with the job
id, and deploys again cleanly."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from contract import etcd_keys, procs
from contract.env import Role
from services.store import states
from tests.services.guardian.helpers import history, start_guardian, submit, wait_for
from tests.services.guardian.test_guardian import assert_clean, run

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


def test_guardian_killed_mid_deploy_rolls_back_and_redeploys_cleanly(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    job = submit(stores["repo"], tmp_path, "sh run.sh", learners=2, files={"run.sh": "sleep 0.5\n"})
    slow = {"RHIZOME_GUARDIAN_STEP_DELAY_S": "0.5"}
    first = start_guardian(job.job_id, stores["etcd_url"], stores["mongo_url"], tmp_path, **slow)
    helper_key = etcd_keys.deploy_step(job.job_id, "helper")
    # Learners are started; the helper step is recorded as started but not done.
    wait_for("the helper step to start", lambda: stores["etcd"].get(helper_key))
    assert len(procs.labelled(job.job_id, role=Role.CONTROLLER)) == 2
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    assert run(stores, tmp_path, job.job_id) == 0
    record = stores["repo"].get(job.job_id)
    assert record.status == states.COMPLETED
    assert record.attempts == 1  # the interrupted deploy counted as one attempt
    assert history(stores["repo"], job.job_id).count("DEPLOYING") == 1
    log = "".join(p.read_text() for p in tmp_path.glob(f"guardian-{job.job_id}-*.log"))
    assert "found a partial deploy" in log
    assert_clean(stores, job.job_id)
