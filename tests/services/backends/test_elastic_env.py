"""An elastic job's learners are told where their workers coordinate (contract/env.py
`RHIZOME_ELASTIC_ETCD`), by the backend, from the platform's etcd; other jobs are not."""

from __future__ import annotations

from pathlib import Path

from contract.env import ELASTIC_ETCD, LearnerEnv
from services.backends.local.backend import learner_env
from tests.services.backends.test_local import spec, typed


def test_an_elastic_jobs_learner_gets_the_platforms_etcd(tmp_path: Path) -> None:
    manifest = typed(learners=2, elastic={"min": 1, "max": 4})
    env = learner_env(spec(tmp_path, manifest=manifest, etcd_url="http://127.0.0.1:2379"), 1)
    assert env[ELASTIC_ETCD] == "http://127.0.0.1:2379"
    assert LearnerEnv.from_environ(env).elastic_etcd == "http://127.0.0.1:2379"


def test_a_manifest_cannot_point_an_elastic_job_at_another_etcd(tmp_path: Path) -> None:
    manifest = typed(
        learners=2, elastic={"min": 1, "max": 4}, env={ELASTIC_ETCD: "http://10.0.0.9:2379"}
    )
    env = learner_env(spec(tmp_path, manifest=manifest, etcd_url="http://127.0.0.1:2379"), 0)
    assert env[ELASTIC_ETCD] == "http://127.0.0.1:2379"


def test_a_job_that_is_not_elastic_gets_no_elastic_etcd(tmp_path: Path) -> None:
    env = learner_env(spec(tmp_path), 0)
    assert ELASTIC_ETCD not in env
    assert LearnerEnv.from_environ(env).elastic_etcd is None
