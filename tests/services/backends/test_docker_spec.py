"""The docker backend without an engine: the container spec (labels, mounts, limits, GPU
device requests, networks), the event view, and the errors of an engine that is down."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from docker.models.containers import _create_container_args
from docker.types import Mount

from services.backends.api import BackendError, JobSpec, backend_names, get_backend
from services.backends.docker.backend import DockerBackend
from services.backends.docker.spec import (
    HOST_ALIAS,
    ContainerOptions,
    container_name,
    container_spec,
    gpu_devices,
    handle_of,
    id_prefix,
    reachable_url,
)
from services.backends.docker.watch import JobWatch
from services.manifest import parse_manifest


def sdk_args(spec: dict[str, Any]) -> dict[str, Any]:
    """What the SDK makes of the arguments (it raises TypeError on an unknown one)."""
    return _create_container_args({**spec, "version": "1.41"})


CODE = [Mount("/opt/py", "/opt/py", type="bind", read_only=True)]


def job(tmp_path: Path, manifest: str = "", **kwargs: Any) -> JobSpec:
    text = "name: t\nframework:\n  command: sh run.sh\n" + manifest
    fields: dict[str, Any] = {
        "job_id": "job-1",
        "command": "sh run.sh",
        "learners": 2,
        "job_dir": str(tmp_path / "jobs" / "job-1"),
        "checkpoint_dir": str(tmp_path / "jobs" / "job-1" / "checkpoints"),
        "result_store": str(tmp_path / "objects" / "results" / "job-1"),
        "etcd_url": "http://127.0.0.1:2379",
        "manifest": parse_manifest(text),
        "generation": 7,
        "model_zip": str(tmp_path / "objects" / "models" / "job-1.zip"),
        "memory_mb": 512.0,
        **kwargs,
    }
    return JobSpec(**fields)


def spec_for(j: JobSpec, rank: int = 1, **kwargs: Any) -> dict[str, Any]:
    options = ContainerOptions(image="rhizome-learner:test", code_mounts=CODE, base_env={"A": "1"})
    path = f"{j.job_dir}/learners/{rank}/spec.json"
    return container_spec(j, rank, 2, path, options, **kwargs)


def test_the_docker_backend_is_registered() -> None:
    assert "docker" in backend_names()
    assert isinstance(get_backend("docker", reaper=None), DockerBackend)


def test_labels_name_user_and_read_only_root(tmp_path: Path) -> None:
    j = job(tmp_path)
    spec = spec_for(j)
    assert spec["name"] == container_name("job-1", 1, 7) == "rz-job-1-1-g7"
    assert spec["labels"]["rhizome.job"] == "job-1"
    assert spec["labels"]["rhizome.rank"] == "1"
    assert spec["labels"]["rhizome.generation"] == "7"
    assert spec["labels"]["rhizome.restart"] == "2"
    assert spec["user"] == "10001:10001"
    assert spec["read_only"] is True and spec["init"] is True
    assert spec["cap_drop"] == ["ALL"] and "no-new-privileges" in spec["security_opt"]
    assert "/tmp" in spec["tmpfs"]
    assert spec["environment"]["RHIZOME_JOB_ID"] == "job-1"
    assert spec["environment"]["A"] == "1"
    # No shell redirecting the controller's output: the container's streams are the
    # command's (the controller logs to controller.log itself, in passthrough).
    assert spec["command"] == [
        "python",
        "-m",
        "learner.controller",
        "--spec",
        f"{j.job_dir}/learners/1/spec.json",
    ]
    assert spec["working_dir"] == f"{j.job_dir}/learners/1"
    # The SDK accepts every argument (it would raise TypeError on an unknown one).
    args = sdk_args(spec)
    assert args["host_config"]["ReadonlyRootfs"] is True


def test_mounts_code_read_only_job_dir_read_write_secrets_read_only(tmp_path: Path) -> None:
    j = job(tmp_path)
    secrets = f"{j.job_dir}/secrets/env"
    mounts = {m["Target"]: m for m in spec_for(j, secrets_file=secrets)["mounts"]}
    assert mounts["/opt/py"]["ReadOnly"] is True
    assert mounts[j.job_dir]["ReadOnly"] is False
    assert mounts[secrets]["ReadOnly"] is True
    assert mounts[j.model_zip]["ReadOnly"] is True
    assert mounts[j.result_store]["ReadOnly"] is False
    # Nothing else of the data directory: not the jobs dir, not the object store.
    assert str(tmp_path / "jobs") not in mounts and str(tmp_path / "objects") not in mounts
    assert all(m["Type"] == "bind" for m in mounts.values())


def test_local_data_stores_are_mounted(tmp_path: Path) -> None:
    data = tmp_path / "store"
    manifest = (
        "data_stores:\n  - id: ds\n    type: local\n"
        f"    training_data: {{container: train}}\n    training_results: {{container: out}}\n"
        f"    connection: {{path: {data}}}\n"
    )
    mounts = {m["Target"]: m for m in spec_for(job(tmp_path, manifest))["mounts"]}
    assert mounts[str(data / "train")]["ReadOnly"] is True
    assert mounts[str(data / "out" / "job-1")]["ReadOnly"] is False


def test_limits_from_the_manifest(tmp_path: Path) -> None:
    spec = spec_for(job(tmp_path, "cpus: 1.5\n", memory_mb=2048.0))
    assert spec["mem_limit"] == "2048m" and spec["memswap_limit"] == "2048m"
    assert spec["nano_cpus"] == 1_500_000_000
    assert spec["pids_limit"] == 4096
    host = sdk_args(spec)["host_config"]
    assert host["Memory"] == 2048 * 1024 * 1024
    assert host["NanoCpus"] == 1_500_000_000
    assert host["PidsLimit"] == 4096
    # the engine's own log of the container is capped (64 MiB x 2 files by default)
    assert host["LogConfig"] == {
        "Type": "json-file",
        "Config": {"max-size": "64m", "max-file": "2"},
    }


def test_gpus_become_an_nvidia_device_request(tmp_path: Path) -> None:
    j = job(tmp_path, "gpus: 2\n", gpus_per_learner=2.0)
    spec = spec_for(j, gpu_ids="2,3")
    (request,) = spec["device_requests"]
    assert request["Driver"] == "nvidia"
    assert request["DeviceIDs"] == ["2", "3"]
    assert request["Capabilities"] == [["gpu"]]
    host = sdk_args(spec)["host_config"]
    assert host["DeviceRequests"][0]["DeviceIDs"] == ["2", "3"]
    # Inside the container the runtime numbers them from 0.
    assert gpu_devices("2,3")[1] == "0,1"
    assert "device_requests" not in spec_for(job(tmp_path))
    assert gpu_devices("") == ([], "")


def test_host_network_or_the_jobs_own(tmp_path: Path) -> None:
    j = job(tmp_path)
    assert spec_for(j)["network_mode"] == "host"
    options = ContainerOptions(image="i", code_mounts=CODE, network="rz-job-1")
    spec = container_spec(j, 0, 0, f"{j.job_dir}/learners/0/spec.json", options)
    assert spec["network"] == "rz-job-1" and "network_mode" not in spec
    assert spec["extra_hosts"] == {HOST_ALIAS: "host-gateway"}
    assert reachable_url("http://127.0.0.1:2379", "host") == "http://127.0.0.1:2379"
    assert reachable_url("http://127.0.0.1:2379", "rz-j") == f"http://{HOST_ALIAS}:2379"
    assert reachable_url("127.0.0.1:50051", "rz-j") == f"{HOST_ALIAS}:50051"
    assert reachable_url("http://10.0.0.5:2379", "rz-j") == "http://10.0.0.5:2379"


def test_handles_round_trip_container_ids() -> None:
    cid = "0123456789abcdef" * 4
    assert cid.startswith(id_prefix(handle_of(cid)))


def test_the_event_view_follows_start_oom_die_destroy() -> None:
    watch = JobWatch(lambda: None, "job-1")  # type: ignore[arg-type,return-value]
    attrs = {"rhizome.job": "job-1", "rhizome.rank": "0", "rhizome.generation": "3", "name": "c"}

    def event(action: str, **extra: str) -> dict[str, Any]:
        return {
            "Action": action,
            "id": "abc",
            "Actor": {"ID": "abc", "Attributes": {**attrs, **extra}},
        }

    watch.apply(event("start"))
    (state,) = watch.states()
    assert state.running and state.rank == 0 and state.generation == 3
    watch.apply(event("oom"))
    watch.apply(event("die", exitCode="137"))
    watch.apply(event("die", exitCode="137"))  # seen twice (stream re-listed): the same
    found = watch.find("abc")
    assert found is not None and not found.running and found.exit_code == 137 and found.oom
    watch.apply(event("destroy"))
    assert watch.find("abc").removed  # type: ignore[union-attr]
    other = {"Action": "start", "id": "zzz", "Actor": {"Attributes": {"rhizome.job": "job-2"}}}
    watch.apply(other)
    assert watch.find("zzz") is None


def test_an_engine_that_is_down_is_a_clear_backend_error(tmp_path: Path) -> None:
    backend = DockerBackend(docker_host=f"unix://{tmp_path}/nothing.sock")
    with pytest.raises(BackendError, match="does not answer"):
        backend.prepare_volume(job(tmp_path))
    with pytest.raises(BackendError, match="does not answer"):
        backend.start_learner(job(tmp_path), 0)
    backend.rollback("job-1", str(tmp_path / "jobs" / "job-1"))  # logged, not raised


def test_a_job_dir_inside_the_read_only_code_mounts_is_refused(tmp_path: Path) -> None:
    backend = DockerBackend(docker_host=f"unix://{tmp_path}/nothing.sock")
    backend.options.code_mounts = [Mount(str(tmp_path), str(tmp_path), type="bind", read_only=True)]
    with pytest.raises(BackendError, match="mount read-only"):
        backend.prepare_volume(job(tmp_path))
