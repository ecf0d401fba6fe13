"""The controller's mirror of the etcd key layout must match services/store/etcd_keys.py."""

from __future__ import annotations

from learner.controller import keys
from services.store import etcd_keys


def test_mirrored_keys_match_the_platform_layout() -> None:
    for job_id in ("job-1", "job-01a2b3c4d5e6f7"):
        assert keys.job_prefix(job_id) == etcd_keys.job_prefix(job_id)
        assert keys.learner_prefix(job_id) == etcd_keys.learner_prefix(job_id)
        assert keys.control(job_id) == etcd_keys.control(job_id)
        for rank in (0, 1, 17):
            assert keys.learner_status(job_id, rank) == etcd_keys.learner_status(job_id, rank)
    assert keys.ROOT == etcd_keys.ROOT
