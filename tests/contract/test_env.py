"""`LearnerEnv` and `RuntimeEnv`: what a backend writes is what a learner reads, and a
bad variable is named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from contract.env import LearnerConfigError, LearnerEnv, Role, RuntimeEnv
from contract.status import ExitCode


def test_nothing_set_means_disabled_with_defaults() -> None:
    env = LearnerEnv.from_environ({})
    assert not env.enabled
    assert env.notice_sources == ("sigterm",)
    assert env.grace_s == 30.0
    assert env.checkpoint_job == "local" and env.checkpoint_root == Path(".rhizome/checkpoints")
    assert env.runtime is None


def test_values_are_parsed() -> None:
    env = LearnerEnv.from_environ(
        {
            "RHIZOME_JOB_ID": "j1",
            "RHIZOME_RANK": "2",
            "RHIZOME_ROLE": "learner",
            "RHIZOME_CHECKPOINT_DIR": "/x",
            "RHIZOME_MTTP_S": "7200",
            "RHIZOME_RESTART_S": "0",
            "RHIZOME_NOTICE_SOURCES": "sigterm, aws",
            "RHIZOME_METADATA_URL": "http://127.0.0.1:9/",
            "RHIZOME_PERIODIC_EVERY_S": "60",
            "RHIZOME_EMERGENCY_EXIT": "0",
        }
    )
    assert env.enabled and env.job_id == "j1" and env.checkpoint_root == Path("/x")
    assert env.rank == 2 and env.role is Role.LEARNER
    assert (env.mttp_s, env.restart_s) == (7200.0, 0.0)
    assert env.notice_sources == ("sigterm", "aws")
    assert env.metadata_url == "http://127.0.0.1:9"
    assert env.periodic_every_s == 60.0
    assert env.emergency_exit is False


def test_what_a_backend_writes_a_learner_reads_back() -> None:
    runtime = RuntimeEnv(
        worker=3,
        stages=2,
        pipelines=2,
        store="127.0.0.1:1234",
        etcd="http://e:1",
        job_id="r",
        microbatches=8,
    )
    written = LearnerEnv(
        job_id="job-1",
        rank=3,
        role=Role.CONTROLLER,
        learner_id="3",
        job_dir="/jobs/job-1",
        checkpoint_dir="/jobs/job-1/checkpoints",
        result_dir="/jobs/job-1/results/3",
        secrets="/jobs/job-1/secrets/env",
        mttp_s=1234.5,
        restart_s=0.0001,
        notice_sources=("sigterm", "gcp"),
        periodic_every_s=90.0,
        keep=4,
        emergency_exit=False,
        checkpoint_policy="fixed",
        checkpoint_interval_s=120.0,
        pipeline_stages=2,
        pipeline_pipelines=2,
        pipeline_redundancy="lazy-frc-lazy-brc",
        pipeline_microbatches=8,
        pipeline_metrics_every=50,
        runtime=runtime,
    )
    environ = written.to_environ()
    assert all(k.startswith("RHIZOME_") for k in environ)
    assert environ["RHIZOME_MTTP_S"] == "1234.500"  # what the platform always wrote
    assert LearnerEnv.from_environ(environ) == written


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("RHIZOME_MTTP_S", "soon", "RHIZOME_MTTP_S='soon' is not a number"),
        ("RHIZOME_MTTP_S", "0", "must be > 0"),
        ("RHIZOME_INSURANCE", "sometimes", "expected one of auto, always, never"),
        ("RHIZOME_KEEP", "-1", "must be >= 0"),
        ("RHIZOME_KEEP", "two", "RHIZOME_KEEP='two' must be a whole number"),
        ("RHIZOME_RANK", "x", "RHIZOME_RANK='x' must be a whole number"),
        ("RHIZOME_ROLE", "boss", "expected one of controller, learner"),
        ("RHIZOME_CHECKPOINT_POLICY", "often", "expected one of adaptive, fixed, none"),
        ("RHIZOME_CHECKPOINT_POLICY", "fixed", "RHIZOME_CHECKPOINT_INTERVAL_S is not set"),
        ("RHIZOME_PIPELINE_STAGES", "0", "must be >= 1"),
        ("RHIZOME_RUNTIME_WORKER", "0", "RHIZOME_RUNTIME_STORE is not set"),
    ],
)
def test_bad_values_name_the_variable(name: str, value: str, match: str) -> None:
    with pytest.raises(LearnerConfigError, match=match) as err:
        LearnerEnv.from_environ({name: value})
    assert err.value.variable.startswith("RHIZOME_")


def test_runtime_variables_are_required_and_checked() -> None:
    full = RuntimeEnv(
        worker=0, stages=1, pipelines=1, store="127.0.0.1:1", etcd="http://e:1", job_id="j"
    ).to_environ()
    assert RuntimeEnv.from_environ(full).resolved_device == "cpu"
    for name in ("RHIZOME_RUNTIME_WORKER", "RHIZOME_RUNTIME_ETCD", "RHIZOME_RUNTIME_STORE"):
        partial = {k: v for k, v in full.items() if k != name}
        with pytest.raises(LearnerConfigError, match=f"{name} is not set") as err:
            RuntimeEnv.from_environ(partial)
        assert err.value.variable == name
    with pytest.raises(LearnerConfigError, match="RHIZOME_RUNTIME_STORE='nope' must be HOST:PORT"):
        RuntimeEnv.from_environ({**full, "RHIZOME_RUNTIME_STORE": "nope"})
    with pytest.raises(LearnerConfigError, match="RHIZOME_RUNTIME_STAGES='0' must be >= 1"):
        RuntimeEnv.from_environ({**full, "RHIZOME_RUNTIME_STAGES": "0"})


def test_a_learner_entry_point_names_a_bad_variable_and_exits_with_the_config_code(
    tmp_path: Path,
) -> None:
    """The checkpoint SDK of a script started with a malformed variable."""
    script = tmp_path / "train.py"
    script.write_text("import learner.sdk as rz\nrz.init()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RHIZOME_")}
    env.update(RHIZOME_JOB_ID="j", RHIZOME_CHECKPOINT_DIR=str(tmp_path), RHIZOME_KEEP="many")
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == ExitCode.CONFIG_ERROR, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "rhizome: RHIZOME_KEEP='many' must be a whole number, e.g. RHIZOME_KEEP=1"
    ]


def test_the_runtime_worker_names_a_missing_variable() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RHIZOME_")}
    proc = subprocess.run(
        [sys.executable, "-m", "learner.runtime.toy"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == ExitCode.CONFIG_ERROR, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "RHIZOME_RUNTIME_STORE is not set" in lines[0], lines


def test_a_pipeline_learner_gets_one_worker_whose_index_is_its_rank() -> None:
    from contract.env import ETCD_STORE

    env = LearnerEnv(
        job_id="job-7",
        rank=3,
        result_dir="/jobs/job-7/results/3",
        pipeline_stages=2,
        pipeline_pipelines=2,
        pipeline_redundancy="none",
        pipeline_microbatches=6,
        pipeline_metrics_every=25,
    )
    runtime = RuntimeEnv.for_learner(env, "http://127.0.0.1:2379")
    assert runtime == RuntimeEnv(
        worker=3,
        stages=2,
        pipelines=2,
        store=ETCD_STORE,
        etcd="http://127.0.0.1:2379",
        job_id="job-7",
        out_dir="/jobs/job-7/results/3",
        redundancy="none",
        microbatches=6,
        metrics_every=25,
    )
    # what the worker reads back is the same record
    assert RuntimeEnv.from_environ(runtime.to_environ()) == runtime
    assert RuntimeEnv.for_learner(LearnerEnv(job_id="j", rank=0), "http://e:1") is None


def test_a_runtime_store_is_host_port_or_etcd() -> None:
    base = RuntimeEnv(worker=0, stages=2, pipelines=1, store="etcd", etcd="http://e:1", job_id="j")
    with pytest.raises(LearnerConfigError, match="RHIZOME_RUNTIME_STORE"):
        RuntimeEnv.from_environ({**base.to_environ(), "RHIZOME_RUNTIME_STORE": "zookeeper"})


def test_a_pipeline_learner_writes_its_step_metrics_where_the_jobs_metric_source_reads() -> None:
    from contract import runtime_metrics

    env = LearnerEnv(job_id="job-7", rank=3, job_dir="/jobs/job-7", pipeline_stages=2)
    runtime = RuntimeEnv.for_learner(env, "http://127.0.0.1:2379")
    assert runtime is not None
    # the learner's directory, where the collector resolves `runtime_metrics.SOURCE["in"]`
    assert runtime.metrics_file == f"/jobs/job-7/learners/3/{runtime_metrics.SOURCE['in']}"
    assert RuntimeEnv.from_environ(runtime.to_environ()).metrics_file == runtime.metrics_file
