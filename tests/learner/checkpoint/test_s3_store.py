"""S3Store against a real S3-compatible server: moto's standalone server on 127.0.0.1.

Same contract as the local store (test_storage.py): commit then latest, a checkpoint
without its COMMITTED marker is never picked (planted, and a writer SIGKILLed mid-upload),
garbage collection keeps what the local store keeps, clear errors.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from contract.procs import free_port
from learner.checkpoint.api import CheckpointKind, StorageError
from learner.checkpoint.s3 import ENDPOINT_ENV, S3Store
from learner.checkpoint.storage import (
    COMMITTED_MARKER,
    META_FILE,
    LocalDirectoryStore,
    open_store,
)
from tests.learner.checkpoint.helpers import kill_writer_when_ready

pytestmark = pytest.mark.integration

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "NO_PROXY": "127.0.0.1",
    "no_proxy": "127.0.0.1",
}


def _moto_server() -> str:
    local = Path(sys.executable).parent / "moto_server"
    found = str(local) if local.exists() else shutil.which("moto_server")
    if not found:
        # A missing test dependency is a failure that says what to install, never a skip.
        pytest.fail(
            "moto_server is not installed: run `make install` (requirements.txt pins moto[server])"
        )
    return found


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [_moto_server(), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "moto_server exited at start"
            try:
                urllib.request.urlopen(url, timeout=1).close()
                break
            except urllib.error.HTTPError:
                break  # it answered
            except OSError:
                assert time.monotonic() < deadline, "moto_server never answered"
                time.sleep(0.1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture
def s3env(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {**CREDENTIALS, ENDPOINT_ENV: endpoint}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture
def bucket(s3env: dict[str, str]) -> str:
    """A fresh bucket per test, so tests never see each other's checkpoints."""
    import boto3

    name = f"ck-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3env[ENDPOINT_ENV]).create_bucket(Bucket=name)
    return name


def _payload(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _all_keys(store: S3Store) -> list[str]:
    return sorted(store._keys())


def test_commit_then_latest_returns_the_newest(bucket: str, tmp_path: Path) -> None:
    store = S3Store(bucket, "job/0")
    store.commit(_payload(tmp_path, "a", "one"), step=10, kind=CheckpointKind.PERIODIC)
    second = store.commit(_payload(tmp_path, "a", "two"), step=20, kind=CheckpointKind.INSURANCE)
    latest = S3Store(bucket, "job/0").latest()  # a fresh store sees it too
    assert latest is not None and latest.name == second.name
    assert latest.step == 20 and latest.kind is CheckpointKind.INSURANCE
    assert latest.path == Path(f"job/0/{second.name}/a")
    assert store.fetch(latest, tmp_path / "got").read_text() == "two"
    # a directory is backed up whole, with its name as the payload
    src = tmp_path / "ckpt"
    (src / "shard").mkdir(parents=True)
    (src / "shard" / "0.bin").write_bytes(b"x" * 10)
    third = store.commit(src, step=30, kind=CheckpointKind.PERIODIC, metadata={"loss": 0.5})
    got = store.fetch(third, tmp_path / "got3")
    assert (got / "shard" / "0.bin").read_bytes() == b"x" * 10
    assert store.latest() == third and third.metadata == {"loss": 0.5}
    assert f"job/0/{third.name}/{COMMITTED_MARKER}" in _all_keys(store)


def test_objects_without_marker_are_never_picked(bucket: str, tmp_path: Path) -> None:
    store = S3Store(bucket, "p")
    good = store.commit(_payload(tmp_path, "a", "good"), step=5, kind=CheckpointKind.PERIODIC)
    # an upload that stopped before the marker: payload and even the metadata are there
    partial = "ckpt-00000009-insurance-s99"
    store.client.put_object(Bucket=bucket, Key=f"p/{partial}/a", Body=b"half")
    store.client.put_object(
        Bucket=bucket,
        Key=f"p/{partial}/{META_FILE}",
        Body=b'{"step": 99, "kind": "insurance", "seq": 9, "payload": "a", '
        b'"committed_at": 1.0, "metadata": {}}',
    )
    listed = S3Store(bucket, "p", clean_partial=False)
    assert [c.name for c in listed.list_committed()] == [good.name]
    # a new commit never reuses the partial's seq
    nxt = listed.commit(_payload(tmp_path, "a", "next"), step=6, kind=CheckpointKind.PERIODIC)
    assert nxt.seq == 10
    reopened = S3Store(bucket, "p")  # a new writer cleans up
    assert not [k for k in _all_keys(reopened) if partial in k]
    assert [c.step for c in reopened.list_committed()] == [5, 6]


_WRITER = """
import sys, time, pathlib
sys.path.insert(0, {repo!r})
from learner.checkpoint.s3 import S3Store
from learner.checkpoint.api import CheckpointKind
bucket, tmp, ready = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
store = S3Store(bucket, "k")
one = tmp / "model.pt"
one.write_text("complete-1")
store.commit(one, step=1, kind=CheckpointKind.PERIODIC)
src = tmp / "sharded"
src.mkdir()
for i in range(3):
    (src / f"{{i}}.bin").write_text("complete-2" * 100)
real_upload = store.client.upload_file
uploads = []

def upload_then_hang(*args, **kwargs):
    real_upload(*args, **kwargs)
    uploads.append(args)
    if len(uploads) == 2:
        open(ready, "w").close()
        time.sleep(600)

store.client.upload_file = upload_then_hang
store.commit(src, step=2, kind=CheckpointKind.INSURANCE)
"""


def test_writer_killed_mid_upload_is_never_picked(
    bucket: str, s3env: dict[str, str], tmp_path: Path
) -> None:
    ready = tmp_path / "ready"
    args = [bucket, str(tmp_path), str(ready)]
    kill_writer_when_ready(_WRITER, args, ready, "the upload", env={**os.environ, **s3env})
    store = S3Store(bucket, "k", clean_partial=False)
    partial = [k for k in _all_keys(store) if "-insurance-s2/" in k]
    assert len(partial) == 2, f"expected two uploaded shards and no marker, got {partial}"
    latest = store.latest()
    assert latest is not None and latest.step == 1
    assert store.fetch(latest, tmp_path / "got").read_text() == "complete-1"
    assert S3Store(bucket, "k").remove_partial() == []  # the open already removed it
    assert not [k for k in _all_keys(store) if "-insurance-s2/" in k]


@pytest.mark.parametrize("keep", [0, 1, 2])
def test_garbage_collection_keeps_what_the_local_store_keeps(
    bucket: str, tmp_path: Path, keep: int
) -> None:
    s3 = S3Store(bucket, f"gc{keep}", keep_periodic=keep)
    local = LocalDirectoryStore(tmp_path / "local", keep_periodic=keep)
    p = _payload(tmp_path, "a", "x")
    kinds = ["periodic", "periodic", "insurance", "periodic", "emergency", "insurance"]
    results: list[Any] = []
    for store in (s3, local):
        deleted_steps: list[int] = []
        for step, kind in enumerate(kinds, start=1):
            store.commit(p, step=step, kind=CheckpointKind(kind))
            deleted_steps += [c.step for c in store.collect_garbage()]
        results.append((sorted(deleted_steps), [c.step for c in store.list_committed()]))
    assert results[0] == results[1]
    kept = results[0][1]
    assert kept[-1] == 6 and len(kept) == keep + 1
    names = {k.split("/")[1] for k in _all_keys(s3)}
    assert names == {c.name for c in s3.list_committed()}  # deleted means gone


def test_open_store_returns_an_s3_store(bucket: str) -> None:
    store = open_store(f"s3://{bucket}/job/3", keep_periodic=2)
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.keep_periodic) == (bucket, "job/3", 2)
    assert store.latest() is None


def test_missing_bucket_and_unreachable_endpoint_are_clear_errors(
    s3env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(StorageError, match=r"bucket 'no-such-bucket' does not exist; create it"):
        open_store("s3://no-such-bucket/x")
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv(ENDPOINT_ENV, dead)
    with pytest.raises(StorageError, match="cannot reach the endpoint") as err:
        open_store("s3://any-bucket/x")
    assert dead in str(err.value) and ENDPOINT_ENV in str(err.value)
    monkeypatch.delenv(ENDPOINT_ENV)
    with pytest.raises(StorageError, match=f"{ENDPOINT_ENV} is not set"):
        open_store("s3://any-bucket/x")
    with pytest.raises(StorageError, match="no bucket"):
        open_store("s3:///x")
    with pytest.raises(StorageError, match="does not exist"):
        S3Store.__new__(S3Store).commit(tmp_path / "nope", step=1, kind=CheckpointKind.PERIODIC)


def test_the_sdk_backs_up_to_s3_and_resumes_from_local_files(
    s3env: dict[str, str], bucket: str, tmp_path: Path
) -> None:
    from contract.env import LearnerEnv
    from learner.checkpoint.manager import CheckpointManager

    env = LearnerEnv.from_environ(
        {
            "RHIZOME_JOB_ID": "job-s3",
            "RHIZOME_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
            "RHIZOME_BACKUP_URL": f"s3://{bucket}/backups",
            "RHIZOME_NOTICE_SOURCES": "",
        }
    )
    manager = CheckpointManager(env, sources=[])
    try:
        saved = tmp_path / "model.pt"
        saved.write_bytes(b"weights at step 7")
        manager.backup(saved, step=7).result(timeout=60)
        assert isinstance(manager.store, S3Store)
        latest = manager.latest_checkpoint()
        assert latest is not None and latest.step == 7
        assert latest.path.exists() and latest.path.read_bytes() == b"weights at step 7"
        assert str(latest.path).startswith(str(tmp_path / "ckpt"))
    finally:
        manager.close()
