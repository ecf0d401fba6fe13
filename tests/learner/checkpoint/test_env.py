from __future__ import annotations

from pathlib import Path

import pytest

from learner.checkpoint.env import CheckpointEnv, EnvError


def test_nothing_set_means_disabled_with_defaults() -> None:
    env = CheckpointEnv.from_env({})
    assert not env.enabled
    assert env.notice_sources == ("sigterm",)
    assert env.grace_s == 30.0


def test_values_are_parsed() -> None:
    env = CheckpointEnv.from_env(
        {
            "RHIZOME_JOB_ID": "j1",
            "RHIZOME_CHECKPOINT_DIR": "/x",
            "RHIZOME_MTTP_S": "7200",
            "RHIZOME_RESTART_S": "0",
            "RHIZOME_NOTICE_SOURCES": "sigterm, aws",
            "RHIZOME_METADATA_URL": "http://127.0.0.1:9/",
            "RHIZOME_PERIODIC_EVERY_S": "60",
            "RHIZOME_EMERGENCY_EXIT": "0",
        }
    )
    assert env.enabled and env.job_id == "j1" and env.checkpoint_dir == Path("/x")
    assert (env.mttp_s, env.restart_s) == (7200.0, 0.0)
    assert env.notice_sources == ("sigterm", "aws")
    assert env.metadata_url == "http://127.0.0.1:9"
    assert env.periodic_every_s == 60.0
    assert env.emergency_exit is False


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("RHIZOME_MTTP_S", "soon", "RHIZOME_MTTP_S='soon' is not a number"),
        ("RHIZOME_MTTP_S", "0", "must be > 0"),
        ("RHIZOME_INSURANCE", "sometimes", "expected one of auto, always, never"),
        ("RHIZOME_KEEP", "-1", "must be >= 0"),
    ],
)
def test_bad_values_name_the_variable(name: str, value: str, match: str) -> None:
    with pytest.raises(EnvError, match=match):
        CheckpointEnv.from_env({name: value})
