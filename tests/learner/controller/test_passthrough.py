"""`command_output: passthrough` (the docker backend's learners): the user command writes
to the controller's own stdout and stderr — a container's output streams, shipped by the
platform's per-job collector — and nothing else does; no log files are written for the
file collector to ship under the same record ids; `files` (the local backend) is as
before. Runs `python -m learner.controller` against the session's real etcd."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from contract import etcd_keys
from contract.etcd import EtcdClient
from contract.learner_spec import CommandOutput, LearnerSpec
from contract.procs import stop_process_group

REPO = Path(__file__).resolve().parents[3]
COMMAND = "echo out-1; echo err-1 >&2; echo out-2"


def run_controller(etcd_url: str, tmp_path: Path, output: str) -> tuple[LearnerSpec, str, str]:
    job_dir = tmp_path / "job"
    spec = LearnerSpec(
        job_id=f"jpass{os.getpid()}{output[:1]}",
        rank=0,
        world_size=1,
        job_dir=str(job_dir),
        command=COMMAND,
        etcd_url=etcd_url,
        command_output=output,
    )
    path = spec.learner_dir / "spec.json"
    spec.dump(path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "learner.controller", "--spec", str(path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        stop_process_group(proc.pid)
    assert proc.returncode == 0, err
    value = EtcdClient(etcd_url).get(etcd_keys.learner_status(spec.job_id, 0))
    assert value is not None and value.value["status"] == "COMPLETED"
    return spec, out, err


@pytest.mark.integration
def test_passthrough_puts_the_commands_output_alone_on_the_controllers_streams(
    etcd_server: object, tmp_path: Path
) -> None:
    url = str(etcd_server.url)  # type: ignore[attr-defined]
    spec, out, err = run_controller(url, tmp_path, CommandOutput.PASSTHROUGH.value)
    assert out.splitlines() == ["out-1", "out-2"]
    assert err.splitlines() == ["err-1"]  # the controller's own log is not in it
    assert not (spec.learner_dir / "stdout.log").exists()
    assert not (spec.learner_dir / "stderr.log").exists()
    assert "COMPLETED" in (spec.learner_dir / "controller.log").read_text()


@pytest.mark.integration
def test_files_keep_the_commands_output_in_the_learner_directory(
    etcd_server: object, tmp_path: Path
) -> None:
    url = str(etcd_server.url)  # type: ignore[attr-defined]
    spec, out, err = run_controller(url, tmp_path, CommandOutput.FILES.value)
    assert (spec.learner_dir / "stdout.log").read_text().splitlines() == ["out-1", "out-2"]
    assert (spec.learner_dir / "stderr.log").read_text().splitlines() == ["err-1"]
    assert "out-1" not in out and "err-1" not in err


def test_an_unknown_command_output_is_refused_naming_the_choices() -> None:
    raw = LearnerSpec(
        job_id="j", rank=0, world_size=1, job_dir="/x", command="true", etcd_url=""
    ).to_json()
    with pytest.raises(
        ValueError, match="command_output is 'stream'; use one of 'files', 'passthrough'"
    ):
        LearnerSpec.from_json(raw.replace('"files"', '"stream"'))
