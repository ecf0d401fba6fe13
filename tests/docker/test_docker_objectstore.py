"""Code, checkpoints and results through the S3 object store on the docker backend:
`rhizomed --backend docker --object-store s3://...` against moto's server (IAM enforced)
and the session's real engine.

The learner container gets no host path of the object store: its controller downloads
the code archive with the job's own session credentials (carried by its spec), the
checkpoint SDK keeps checkpoints in the store, results are uploaded there, and when the
job ends the credentials are revoked. The credentials appear neither in the container's
environment nor in the job's logs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import botocore.exceptions
import docker
import pytest

from contract.learner_spec import LearnerSpec
from services.client.sdk import Client
from services.objectstore.s3 import role_name
from services.store import states
from tests.docker.conftest import DockerEngine, DockerPlatform, LearnerImage, started_platform
from tests.docker.test_docker_backend import TERMINAL, containers, manifest, wait_status
from tests.services.guardian.helpers import code_zip, wait_for
from tests.services.objectstore.server import MotoS3

pytestmark = [pytest.mark.integration, pytest.mark.docker]

PREFIX = "plat"
# Waits for the test's go-ahead (so it can inspect the running container), then
# resumes from the latest checkpoint, backs up three steps and writes a result.
TRAIN = """
import os, time
import learner.sdk as rz

go = os.path.join(os.environ["RHIZOME_JOB_DIR"], "go")
for _ in range(600):
    if os.path.exists(go):
        break
    time.sleep(0.1)
ckpt = rz.latest_checkpoint()
start = int(open(ckpt.path).read()) if ckpt else 0
print("resumed from", start, "backup to", os.environ["RHIZOME_BACKUP_URL"], flush=True)
for i in range(start, 3):
    with rz.step():
        pass
    path = rz.staging_path("state.txt")
    path.write_text(str(i + 1))
    rz.backup(path, step=i + 1)
rz.wait_backups()
result = os.environ["RHIZOME_RESULT_DIR"]
os.makedirs(result, exist_ok=True)
open(os.path.join(result, "out.txt"), "w").write("done")
print("trained", flush=True)
"""


@pytest.fixture(scope="module")
def moto_s3() -> Iterator[MotoS3]:
    server = MotoS3().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def s3_platform(
    etcd_server: Any,
    mongo_server: Any,
    docker_engine: DockerEngine,
    learner_image: LearnerImage,
    moto_s3: MotoS3,
    es_server: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[DockerPlatform]:
    with started_platform(
        Path(tmp_path_factory.mktemp("s3platform")),
        etcd_server,
        mongo_server,
        es_server,
        docker_engine,
        [
            f"--object-store=s3://{moto_s3.bucket}/{PREFIX}",
            f"--object-store-endpoint={moto_s3.url}",
        ],
        **moto_s3.platform_env,
    ) as platform:
        yield platform


def keys(moto_s3: MotoS3, prefix: str) -> list[str]:
    found = moto_s3.platform_client().list_objects_v2(Bucket=moto_s3.bucket, Prefix=prefix)
    return sorted(str(o["Key"]) for o in found.get("Contents", []))


def test_code_checkpoints_and_results_go_through_the_store(
    s3_platform: DockerPlatform, moto_s3: MotoS3, docker_client: docker.DockerClient
) -> None:
    with Client(s3_platform.address, token=s3_platform.token()) as client:
        job_id = client.create_job(
            manifest("s3job", "python train.py"), code_zip({"train.py": TRAIN})
        ).job_id
    # The archive went to the store, not to the daemon's disk.
    assert keys(moto_s3, f"{PREFIX}/models/") == [f"{PREFIX}/models/{job_id}.zip"]
    assert not (s3_platform.data_dir / "objects" / "models" / f"{job_id}.zip").exists()

    wait_for("the learner container", lambda: containers(docker_client, job_id, False), 120)
    (container,) = containers(docker_client, job_id, all=False)
    job_dir = s3_platform.data_dir / "jobs" / job_id
    spec = LearnerSpec.load(job_dir / "learners" / "0" / "spec.json")
    access = spec.storage_access
    assert access is not None and access.kind == "s3" and spec.model_zip == ""
    mounts = [m["Source"] for m in container.attrs["Mounts"]]
    assert not any(m.startswith(str(s3_platform.data_dir / "objects")) for m in mounts)
    env = "\n".join(container.attrs["Config"]["Env"])
    assert access.secret_access_key not in env and access.session_token not in env
    (job_dir / "go").write_text("")

    record = wait_status(s3_platform, job_id, TERMINAL, timeout=180)
    assert record.status == states.COMPLETED, (record.status_message, record.last_log_lines)
    stdout = s3_platform.learner_output(job_id)
    assert f"backup to s3://{moto_s3.bucket}/{PREFIX}/checkpoints" in stdout
    assert "trained" in stdout
    results = keys(moto_s3, f"{PREFIX}/results/{job_id}/")
    assert results == [f"{PREFIX}/results/{job_id}/0/out.txt"]
    checkpoints = keys(moto_s3, f"{PREFIX}/checkpoints/{job_id}/")
    assert sum(k.endswith("/COMMITTED") for k in checkpoints) >= 1
    # Nothing of the store on the daemon's disk, and no secret in any log.
    assert not (s3_platform.data_dir / "objects" / "results" / job_id).exists()
    collector_dir = s3_platform.data_dir / "jobs" / ".container-logs" / job_id
    logs = [*(job_dir / "learners" / "0").glob("*.log"), *collector_dir.glob("*.log")]
    assert collector_dir / "collector.log" in logs
    for text in [stdout, *(log.read_text() for log in logs)]:
        assert access.secret_access_key not in text and access.session_token not in text

    # The job ended: its credentials are revoked.
    policy = moto_s3.platform_client("iam").get_role_policy(
        RoleName=role_name(job_id), PolicyName="rhizome-job-objects"
    )["PolicyDocument"]
    document = policy if isinstance(policy, dict) else json.loads(policy)
    assert [s["Effect"] for s in document["Statement"]] == ["Deny"]
    job_client = moto_s3.client(
        "s3", access.access_key_id, access.secret_access_key, access.session_token
    )
    with pytest.raises(botocore.exceptions.ClientError) as denied:
        job_client.get_object(Bucket=access.bucket, Key=results[0])
    assert denied.value.response["Error"]["Code"] == "AccessDenied"
    wait_for("no container left", lambda: containers(docker_client, job_id) == [], 30)
