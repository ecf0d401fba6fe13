"""Scaling a running elastic job, the LCM's and the guardian's side (real etcd and
MongoDB-wire server, the local backend): bad requests are refused with the reason, the
later request wins, and a scale-out whose added learner fails is rolled back to the old
size with the reason in the history."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from contract import etcd_keys
from services.guardian.elastic import REQUEST, ScaleRefused, request_scale
from services.store import states
from tests.services.guardian.helpers import start_guardian, submit, wait_for

pytestmark = pytest.mark.integration

ELASTIC: dict[str, Any] = {"elastic": {"min": 1, "max": 3}}
# Every rank runs until the test creates <job dir>/stop; rank 2 fails at once.
SCRIPT = """if [ "$RHIZOME_RANK" = 2 ]; then echo "rank 2 cannot start" >&2; exit 5; fi
while [ ! -e ../stop ]; do sleep 0.1; done
"""


def running(stores: dict[str, Any], tmp_path: Path, **extra: Any) -> str:
    """A job recorded as deployed and PROCESSING (no guardian runs)."""
    repo, etcd = stores["repo"], stores["etcd"]
    job = submit(repo, tmp_path, "true", learners=2, **extra)
    for status in (states.DEPLOYING, states.PROCESSING):
        repo.transition(job.job_id, status, status.lower())
    etcd.put(etcd_keys.deploy_step(job.job_id, "complete"), {"generation": 1})
    return job.job_id


def test_a_job_without_elastic_bounds_is_refused_saying_how_to_add_them(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    job_id = running(stores, tmp_path)
    with pytest.raises(ScaleRefused, match=r"not elastic; add `elastic: \{min: M, max: N\}`"):
        request_scale(stores["etcd"], stores["repo"], job_id, 3, "t")


def test_a_count_outside_the_bounds_is_refused_naming_them(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    job_id = running(stores, tmp_path, **ELASTIC)
    with pytest.raises(
        ScaleRefused, match=r"learners=4 is outside the job's elastic bounds \[1, 3\]"
    ):
        request_scale(stores["etcd"], stores["repo"], job_id, 4, "t")


def test_a_job_that_is_not_running_is_refused(stores: dict[str, Any], tmp_path: Path) -> None:
    job = submit(stores["repo"], tmp_path, "true", learners=2, **ELASTIC)  # PENDING
    with pytest.raises(ScaleRefused, match="is PENDING: a running job is scaled once"):
        request_scale(stores["etcd"], stores["repo"], job.job_id, 3, "t")


def test_the_later_of_two_pending_requests_wins_and_says_so(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    job_id = running(stores, tmp_path, **ELASTIC)
    request_scale(stores["etcd"], stores["repo"], job_id, 3, "first")
    message = request_scale(stores["etcd"], stores["repo"], job_id, 1, "second")
    assert message.endswith("scaling to 1 learners (replaces the pending request for 3)")
    pending = stores["etcd"].get(etcd_keys.deploy_step(job_id, REQUEST)).value
    assert (pending["learners"], pending["reason"]) == (1, "second")


def test_a_scale_out_whose_new_learner_fails_is_rolled_back_to_the_old_size(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    repo = stores["repo"]
    job = submit(repo, tmp_path, "sh run.sh", learners=2, files={"run.sh": SCRIPT}, **ELASTIC)
    guardian = start_guardian(job.job_id, stores["etcd_url"], stores["mongo_url"], tmp_path)
    try:
        wait_for("PROCESSING", lambda: repo.get(job.job_id).status == states.PROCESSING)
        request_scale(stores["etcd"], repo, job.job_id, 3, "scaled by the test")
        wait_for(
            "the rollback",
            lambda: any("rolled back" in h.message for h in repo.get(job.job_id).history),
        )
        record = repo.get(job.job_id)
        assert record.status == states.PROCESSING
        assert record.resources["learners"] == 2
        assert set(record.placement["learner_nodes"]) == {"0", "1"}
        messages = [h.message for h in record.history]
        assert "scaling 2 → 3 learners (scaled by the test)" in messages
        rollback = next(m for m in messages if "rolled back" in m)
        assert rollback.startswith("scale 2 → 3 learners rolled back: learner 2 exited with code 5")
        assert rollback.endswith("the job runs on 2 learners")
        (tmp_path / "jobs" / job.job_id / "stop").touch()
        wait_for("COMPLETED", lambda: repo.get(job.job_id).status == states.COMPLETED)
        assert guardian.wait(timeout=30) == 0
    finally:
        if guardian.poll() is None:
            guardian.kill()
            guardian.wait()


def test_a_request_that_comes_too_late_is_noted_not_applied(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    """Taken while PROCESSING, found by the guardian once the learners are STORING: the
    job finishes on its size and the history says the request was not applied."""
    from types import SimpleNamespace

    from services.guardian.elastic import ElasticScaler

    repo, etcd = stores["repo"], stores["etcd"]
    job_id = running(stores, tmp_path, **ELASTIC)
    request_scale(etcd, repo, job_id, 3, "late")
    repo.transition(job_id, states.STORING, "storing")
    guardian = SimpleNamespace(etcd=etcd, jobs=repo, job_id=job_id)
    scaler = ElasticScaler(guardian)  # type: ignore[arg-type]
    job, _ = scaler.apply(repo.get(job_id), None)  # type: ignore[arg-type]
    assert job.status == states.STORING and job.resources["learners"] == 2
    assert job.history[-1].message == "scale to 3 learners not applied: the job is STORING"
    job, _ = scaler.apply(repo.get(job_id), None)  # type: ignore[arg-type]
    assert job.history[-1].message == "scale to 3 learners not applied: the job is STORING"
    assert len([h for h in job.history if "not applied" in h.message]) == 1  # applied once
