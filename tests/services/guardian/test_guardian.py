"""The guardian against real etcd and a real MongoDB-wire server, as a real process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from contract import etcd_keys, procs
from services.guardian.guardian import EXIT_ALREADY_GUARDED
from services.store import states
from tests.services.guardian.helpers import history, start_guardian, submit, wait_for

pytestmark = pytest.mark.integration


def run(
    stores: dict[str, Any], tmp_path: Path, job_id: str, timeout: float = 90, **env: str
) -> int:
    proc = start_guardian(job_id, stores["etcd_url"], stores["mongo_url"], tmp_path, **env)
    return proc.wait(timeout=timeout)


def assert_clean(stores: dict[str, Any], job_id: str) -> None:
    assert stores["etcd"].get_prefix(etcd_keys.job_prefix(job_id)) == {}
    assert procs.labelled(job_id) == []


def test_two_learners_complete_with_env_and_ordered_history(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    script = (
        'echo "rank=$RANK world=$WORLD_SIZE master=$MASTER_ADDR:$MASTER_PORT local=$LOCAL_RANK"\n'
    )
    job = submit(stores["repo"], tmp_path, "sh run.sh", learners=2, files={"run.sh": script})
    assert run(stores, tmp_path, job.job_id) == 0
    record = stores["repo"].get(job.job_id)
    assert record.status == states.COMPLETED
    assert history(stores["repo"], job.job_id) == [
        "QUEUED", "PENDING", "DEPLOYING", "DOWNLOADING", "PROCESSING", "STORING", "COMPLETED",
    ]  # fmt: skip
    times = [h.time for h in record.history]
    assert times == sorted(times)
    for rank in (0, 1):
        out = (tmp_path / "jobs" / job.job_id / "learners" / str(rank) / "stdout.log").read_text()
        assert f"rank={rank} world=2 master=127.0.0.1:" in out
        assert f"local={rank}" in out
    assert_clean(stores, job.job_id)


def test_failing_learner_is_restarted_then_fails_the_job_with_code_and_lines(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    script = "echo attempt >> ../attempts\necho 'boom: bad input' >&2\nexit 7\n"
    job = submit(
        stores["repo"], tmp_path, "sh run.sh", files={"run.sh": script}, max_learner_restarts=1
    )
    assert run(stores, tmp_path, job.job_id) == 0
    record = stores["repo"].get(job.job_id)
    assert record.status == states.FAILED
    assert record.exit_code == 7
    assert any("boom: bad input" in line for line in record.last_log_lines)
    assert "learner 0 exited with code 7 after 1 restarts" in record.status_message
    assert (tmp_path / "jobs" / job.job_id / "attempts").read_text().count("attempt") == 2
    assert_clean(stores, job.job_id)


def test_failed_step_rolls_back_and_the_retry_deploys(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    job = submit(stores["repo"], tmp_path, "true")
    assert run(stores, tmp_path, job.job_id, RHIZOME_GUARDIAN_FAIL_STEP="helper:1") == 0
    record = stores["repo"].get(job.job_id)
    assert record.status == states.COMPLETED
    assert record.attempts == 1
    # The retry stayed in DEPLOYING: one DEPLOYING entry, no illegal re-entry.
    assert history(stores["repo"], job.job_id).count("DEPLOYING") == 1
    assert_clean(stores, job.job_id)


def test_deploy_gives_up_after_the_configured_attempts(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    job = submit(stores["repo"], tmp_path, "true")
    code = run(
        stores,
        tmp_path,
        job.job_id,
        RHIZOME_GUARDIAN_FAIL_STEP="secrets",
        RHIZOME_DEPLOY_ATTEMPTS="2",
    )
    assert code == 0
    record = stores["repo"].get(job.job_id)
    assert record.status == states.FAILED
    assert "deploy failed after 2 attempts" in record.status_message
    assert "step secrets failed" in record.status_message
    assert_clean(stores, job.job_id)


def test_a_second_guardian_for_the_same_job_exits_at_once(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    job = submit(stores["repo"], tmp_path, "sleep 30")
    first = start_guardian(job.job_id, stores["etcd_url"], stores["mongo_url"], tmp_path)
    try:
        wait_for(
            "the first guardian's key",
            lambda: stores["etcd"].get(etcd_keys.guardian_lease(job.job_id)),
        )
        assert run(stores, tmp_path, job.job_id, timeout=30) == EXIT_ALREADY_GUARDED
    finally:
        stores["etcd"].put(
            etcd_keys.control(job.job_id), {"action": "delete", "reason": "test over"}
        )
        first.wait(timeout=30)
    assert stores["repo"].get(job.job_id).status == states.DELETED
    assert_clean(stores, job.job_id)


def test_halt_stops_learners_with_sigterm_and_marks_halted(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    # The command says when its handler is in place: PROCESSING comes as soon as it is
    # spawned, and a SIGTERM before `trap` ran would end the shell without a save (seen on
    # a loaded machine).
    script = (
        "trap 'echo saved > ../saved; exit 143' TERM\ntouch ../ready\n"
        "while true; do sleep 0.1; done\n"
    )
    job = submit(stores["repo"], tmp_path, "sh run.sh", files={"run.sh": script})
    proc = start_guardian(job.job_id, stores["etcd_url"], stores["mongo_url"], tmp_path)
    wait_for("PROCESSING", lambda: stores["repo"].get(job.job_id).status == states.PROCESSING)
    wait_for("the handler", lambda: (tmp_path / "jobs" / job.job_id / "ready").exists())
    stores["etcd"].put(etcd_keys.control(job.job_id), {"action": "halt", "reason": "user halt"})
    assert proc.wait(timeout=60) == 0
    assert stores["repo"].get(job.job_id).status == states.HALTED
    assert (tmp_path / "jobs" / job.job_id / "saved").read_text().strip() == "saved"
    assert_clean(stores, job.job_id)
