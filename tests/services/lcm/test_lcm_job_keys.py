"""The LCM's rounds read the jobs prefix from a watched view (services/lcm/job_keys.py),
not from etcd every round (issue #16: five reads a second, the running jobs' keys
included): a round with nothing changed reads no etcd key, a guardian key's change wakes
the round, and a finished job's leftover keys are still collected. Real etcd and
MongoDB-wire server; the LCM's rounds are called by the test."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from contract import etcd_keys
from contract.etcd import EtcdClient
from services.lcm.manager import LcmConfig, LifecycleManager
from services.store import states
from services.store.jobs import JobsRepository
from services.store.mongo import connect
from tests.services.guardian.helpers import submit, wait_for
from tests.services.lcm.recording_repo import RecordingRepo

pytestmark = pytest.mark.integration


class CountingEtcd:
    """The LCM's etcd client, counting its reads (everything else passes through; the
    view's own watch and its first read go through `raw`, not counted)."""

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self.reads: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name not in ("get", "get_prefix"):
            return attr

        def counted(key: str, *args: Any, **kwargs: Any) -> Any:
            self.reads.append(key)
            return attr(key, *args, **kwargs)

        return counted


def test_rounds_read_the_watched_view_wake_on_a_guardian_key_and_still_collect(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    # A database of its own: a round looks at every active job in it (none here).
    repo = JobsRepository(connect(stores["mongo_url"], f"job_keys_{uuid.uuid4().hex[:8]}"))
    repo.ensure_indexes()
    etcd = CountingEtcd(stores["etcd"])
    config = LcmConfig(tmp_path, stores["etcd_url"], stores["mongo_url"], guardians_per_host=0)
    lcm = LifecycleManager(config, repo, etcd)  # type: ignore[arg-type]
    try:
        lcm.reconcile()  # starts the view
        etcd.reads.clear()
        for _ in range(5):
            lcm.reconcile()
        assert etcd.reads == [], "a round with nothing changed read etcd"

        # A job that is not active (no record at all) left keys, its guardian dead: the
        # guardian key's arrival wakes the round, which collects them.
        ghost = f"ghost-{uuid.uuid4().hex[:8]}"
        lcm.wake.clear()
        stores["etcd"].put(etcd_keys.learner_status(ghost, 0), {"status": "COMPLETED"})
        assert not lcm.wake.wait(0.5), "a learner's key woke the round"
        stores["etcd"].put(
            etcd_keys.guardian_lease(ghost), {"pid": 999_999_999, "start": 1, "lease": 0}
        )
        wait_for("the guardian key to wake the round", lcm.wake.is_set, timeout_s=30)
        lcm.reconcile()
        assert stores["etcd"].get_prefix(etcd_keys.job_prefix(ghost)) == {}
        # the view heard the deletion: the next rounds neither see nor collect it again
        wait_for(
            "the view to drop the ghost's keys",
            lambda: not any(ghost in k for k in lcm.job_keys()),
            timeout_s=30,
        )
        etcd.reads.clear()
        lcm.reconcile()
        assert etcd.reads == [], etcd.reads
    finally:
        lcm.stop()


def test_a_round_reads_ids_statuses_and_manifests_not_whole_records(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    # Five rounds a second read every active job: the records' histories, checkpoints and
    # placements were most of what the MongoDB-wire server encoded for them.
    repo = JobsRepository(connect(stores["mongo_url"], f"lcm_reads_{uuid.uuid4().hex[:8]}"))
    repo.ensure_indexes()
    queued = submit(repo, tmp_path, "true", place=False)
    placed = submit(repo, tmp_path, "true", learners=2)  # PENDING: active
    assert repo.manifests_by_status(states.ACTIVE_STATES) == [
        (placed.job_id, states.PENDING, placed.manifest)
    ]
    assert [j for j, _, _ in repo.manifests_by_status({states.QUEUED})] == [queued.job_id]

    recording = RecordingRepo(JobsRepository(connect(stores["mongo_url"], "lcm_reads_empty")))
    config = LcmConfig(tmp_path, stores["etcd_url"], stores["mongo_url"], place_locally=False)
    lcm = LifecycleManager(config, recording, stores["etcd"])  # type: ignore[arg-type]
    try:
        lcm.reconcile()
    finally:
        lcm.stop()
    assert "manifests_by_status" in recording.calls
    assert "by_status" not in recording.calls
