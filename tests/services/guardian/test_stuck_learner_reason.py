"""A learner whose controller never comes up (on Kubernetes: a pod stuck Pending or in
ImagePullBackOff) fails the job with the backend's reason in its message, not only
"controller died N times". An in-process guardian over the real etcd and MongoDB-wire
server; the backend is the local one with learners that never start (the one fake part,
standing in for a cluster that cannot run the pod)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.backends.api import JobSpec
from services.backends.local.backend import LocalBackend
from services.guardian.config import GuardianConfig
from services.guardian.guardian import Guardian
from services.store import states
from tests.services.guardian.helpers import submit

pytestmark = pytest.mark.integration

REASON = "pod rz-job-0 stuck in ImagePullBackOff: image 'nope:1' not found"


class NeverStartingBackend(LocalBackend):
    """Deploys like the local backend, but no learner controller ever claims its rank."""

    def start_learner(self, job: JobSpec, rank: int, restart: int = 0) -> int:
        return -1

    def learner_exited(self, handle: int) -> int | None:
        return 1  # gone at once, as a pod the cluster deleted

    def exit_note(self, job_id: str, rank: int) -> str:
        return REASON


def test_a_learner_that_never_starts_fails_the_job_with_the_backends_reason(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    job = submit(stores["repo"], tmp_path, "true")
    config = GuardianConfig(
        job_id=job.job_id,
        etcd_url=stores["etcd_url"],
        mongodb_uri=stores["mongo_url"],
        data_dir=tmp_path,
        platform_restarts=2,
        start_grace_s=0.1,
    )
    guardian = Guardian(config, stores["etcd"], stores["repo"], NeverStartingBackend())
    assert guardian.run() == 0
    record = stores["repo"].get(job.job_id)
    assert record.status == states.FAILED
    assert "learner 0's controller died 3 times" in record.status_message
    assert REASON in record.status_message
