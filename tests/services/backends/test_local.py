"""The local backend's environment, devices, registry and files (no platform needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.backends.api import JobSpec, UnknownBackend, backend_names, get_backend
from services.backends.local.backend import LocalBackend, learner_env, visible_devices
from services.manifest import Manifest, parse_manifest


def typed(**fields: object) -> Manifest:
    """A validated manifest with these fields besides the required ones."""
    return parse_manifest(json.dumps({"name": "t", "framework": {"command": "true"}, **fields}))


def spec(tmp_path: Path, **kw: object) -> JobSpec:
    base: dict[str, object] = {
        "manifest": typed(learners=3),
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
    job = spec(tmp_path, manifest=typed(env={"LR": 0.1}), gpus_per_learner=2)
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
        manifest=typed(
            data_stores=[{"id": "s3", "type": "s3_datastore", "connection": {"key": "k1"}}]
        ),
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


def test_the_manifests_checkpoint_and_pipeline_sections_reach_the_learner(tmp_path: Path) -> None:
    manifest = typed(
        checkpoint={"policy": "fixed", "interval_s": 90, "keep": 3, "grace_s": 25},
        pipeline={"stages": 3, "microbatches": 8, "metrics_every": 20},
    )
    env = learner_env(spec(tmp_path, manifest=manifest, grace_s=25.0), 0)
    assert env["RHIZOME_CHECKPOINT_POLICY"] == "fixed"
    assert float(env["RHIZOME_CHECKPOINT_INTERVAL_S"]) == 90.0
    assert env["RHIZOME_KEEP"] == "2"  # besides the newest
    assert float(env["RHIZOME_GRACE_S"]) == 25.0
    assert env["RHIZOME_PIPELINE_STAGES"] == "3" and env["RHIZOME_PIPELINE_PIPELINES"] == "1"
    assert env["RHIZOME_PIPELINE_REDUNDANCY"] == "eager-frc-lazy-brc"  # the schema default
    assert env["RHIZOME_PIPELINE_MICROBATCHES"] == "8"
    assert env["RHIZOME_PIPELINE_METRICS_EVERY"] == "20"


def test_an_explicit_env_variable_wins_but_not_over_the_real_grace(tmp_path: Path) -> None:
    manifest = typed(checkpoint={"keep": 3}, env={"RHIZOME_KEEP": "7", "RHIZOME_GRACE_S": "999"})
    env = learner_env(spec(tmp_path, manifest=manifest, grace_s=10.0), 0)
    assert env["RHIZOME_KEEP"] == "7"
    # The learner is told the grace the platform really gives before SIGKILL.
    assert float(env["RHIZOME_GRACE_S"]) == 10.0


def test_credentials_reach_the_secrets_file_but_never_the_learner_spec(tmp_path: Path) -> None:
    from contract.learner_spec import LearnerSpec

    manifest = typed(
        data_stores=[
            {"id": "s3", "type": "s3_datastore", "connection": {"secret_key": "hunter2"}},
            {"id": "disk", "type": "local", "connection": {"path": str(tmp_path)}},
        ]
    )
    job = spec(tmp_path, manifest=manifest, learners=1, command="sleep 30")
    backend = LocalBackend()
    backend.prepare_volume(job)
    backend.write_secrets(job)
    try:
        backend.start_learner(job, 0)
        spec_json = (Path(job.job_dir) / "learners" / "0" / "spec.json").read_text()
    finally:
        backend.rollback(job.job_id, job.job_dir)
    assert "hunter2" not in spec_json
    stores = LearnerSpec.from_json(spec_json).data_stores
    assert stores == [{"id": "disk", "type": "local", "connection": {"path": str(tmp_path)}}]


def test_ffdl_containers_pick_the_data_folder_and_a_second_results_location(
    tmp_path: Path,
) -> None:
    from contract.learner_spec import LearnerSpec
    from learner.controller.controller import Controller
    from services.backends.local.backend import local_stores

    store_root = tmp_path / "store"
    manifest = typed(
        data_stores=[
            {
                "id": "disk",
                "type": "local",
                "training_data": {"container": "mnist"},
                "training_results": {"container": "out"},
                "connection": {"path": str(store_root)},
            }
        ]
    )
    job = spec(tmp_path, manifest=manifest)
    (entry,) = local_stores(job, 1)
    assert entry["connection"]["path"] == str(store_root / "mnist")
    assert entry["results_path"] == str(store_root / "out" / "job-x" / "1")

    learner_spec = LearnerSpec(
        job_id="job-x",
        rank=1,
        world_size=3,
        job_dir=job.job_dir,
        command="true",
        etcd_url="http://127.0.0.1:1",
        result_store=str(tmp_path / "objects" / "results" / "job-x" / "1"),
        data_stores=[entry],
    )
    learner_spec.result_dir.mkdir(parents=True)
    (learner_spec.result_dir / "model.pt").write_text("weights")
    Controller(learner_spec, etcd=None).store_results()  # type: ignore[arg-type]
    assert (store_root / "out" / "job-x" / "1" / "model.pt").read_text() == "weights"
    assert (tmp_path / "objects" / "results" / "job-x" / "1" / "model.pt").exists()
