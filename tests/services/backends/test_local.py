"""The local backend's environment, devices, registry and files (no platform needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.backends.api import JobSpec, UnknownBackend, backend_names, get_backend
from services.backends.local.backend import LocalBackend, learner_env, visible_devices


def spec(tmp_path: Path, **kw: object) -> JobSpec:
    base: dict[str, object] = {
        "job_id": "job-x",
        "command": "true",
        "learners": 3,
        "job_dir": str(tmp_path / "jobs" / "job-x"),
        "checkpoint_dir": str(tmp_path / "jobs" / "job-x" / "checkpoints"),
        "result_store": str(tmp_path / "objects" / "results" / "job-x"),
        "etcd_url": "http://127.0.0.1:1",
        "master_port": 29500,
        "placement": {"learner_nodes": {"0": "a", "1": "b", "2": "a"}},
    }
    base.update(kw)
    return JobSpec(**base)  # type: ignore[arg-type]


def test_learner_env_has_what_a_distributed_job_needs(tmp_path: Path) -> None:
    job = spec(tmp_path, manifest={"env": {"LR": 0.1}}, gpus_per_learner=2)
    env = learner_env(job, 2)
    assert env["RANK"] == "2" and env["WORLD_SIZE"] == "3"
    assert env["LOCAL_RANK"] == "1" and env["LOCAL_WORLD_SIZE"] == "2"  # ranks 0 and 2 on "a"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "29500"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["RHIZOME_JOB_ID"] == "job-x"
    assert env["RHIZOME_CHECKPOINT_DIR"].endswith("job-x/checkpoints")
    assert env["RHIZOME_RESULT_DIR"].endswith("job-x/results/2")
    assert env["LR"] == "0.1"


def test_visible_devices_follow_the_placement_then_fall_back(tmp_path: Path) -> None:
    assert visible_devices(spec(tmp_path, placement={"gpu_ids": {"1": [5, 7]}}), 1, 0) == "5,7"
    assert visible_devices(spec(tmp_path), 0, 0) == ""  # no GPUs asked for
    assert visible_devices(spec(tmp_path, gpus_per_learner=0.5), 0, 1) == "1"


def test_registry_builds_by_name_and_names_the_choices() -> None:
    assert "local" in backend_names()
    assert isinstance(get_backend("local"), LocalBackend)
    with pytest.raises(UnknownBackend, match=r"registered: .*local"):
        get_backend("slurm")


def test_volume_secrets_and_rollback_keep_checkpoints_and_logs(tmp_path: Path) -> None:
    job = spec(
        tmp_path,
        manifest={
            "data_stores": [{"id": "s3", "type": "s3_datastore", "connection": {"key": "k1"}}]
        },
    )
    backend = LocalBackend()
    root = Path(job.job_dir)
    (root / "code").mkdir(parents=True)
    (root / "code" / "stale.py").write_text("old")
    backend.prepare_volume(job)
    assert not (root / "code").exists()  # code from an earlier deploy is gone
    assert (root / "checkpoints").is_dir()
    backend.write_secrets(job)
    secret = root / "secrets" / "env"
    assert secret.read_text() == "S3_KEY=k1\n"
    assert secret.stat().st_mode & 0o077 == 0
    (root / "checkpoints" / "ckpt").write_text("keep")
    (root / "learners" / "0").mkdir(parents=True)
    (root / "learners" / "0" / "stderr.log").write_text("a\nb\nTraceback: boom\n")
    backend.rollback(job.job_id, job.job_dir)
    assert not (root / "secrets").exists()
    assert (root / "checkpoints" / "ckpt").read_text() == "keep"
    assert backend.log_tail(job.job_dir, 0, lines=2) == ["[stderr] b", "[stderr] Traceback: boom"]


def test_missing_code_fails_the_volume_step_clearly(tmp_path: Path) -> None:
    from services.backends.api import BackendError

    job = spec(tmp_path, model_zip=str(tmp_path / "nope.zip"))
    with pytest.raises(BackendError, match="missing from the object store"):
        LocalBackend().prepare_volume(job)
