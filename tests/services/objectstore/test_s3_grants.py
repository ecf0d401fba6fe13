"""Job-scoped, expiring credentials for the platform's S3 object store, against moto's
S3/IAM/STS server with IAM enforcement switched on (tests/services/objectstore/server.py).

A job's learners read its code archive and keep checkpoints and results through the
checkpoint SDK's own S3 store; another job's code and checkpoints are refused to them;
after `revoke` (rollback or the end of the job) their credentials are refused everything.
moto does not enforce a session's expiry: what is tested is the `Expiration` the grant
carries (STS enforces it on AWS) and that the learner refuses expired credentials itself.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import botocore.exceptions
import pytest

from contract.learner_spec import StorageAccess
from learner.checkpoint.api import CheckpointKind
from learner.checkpoint.s3 import S3Store
from learner.controller.fetch import CodeFetchError, download_archive, s3_client
from services.objectstore.api import (
    ObjectNotFound,
    ObjectStoreError,
    UnknownObjectStore,
    open_object_store,
)
from services.objectstore.s3 import S3ObjectStore
from tests.services.objectstore.server import MotoS3

pytestmark = pytest.mark.integration


@pytest.fixture()
def store(moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3ObjectStore]:
    for key, value in moto_s3.platform_env.items():
        monkeypatch.setenv(key, value)
    yield S3ObjectStore(moto_s3.bucket, f"p-{uuid.uuid4().hex[:6]}", endpoint_url=moto_s3.url)


def job_client(moto_s3: MotoS3, access: StorageAccess) -> Any:
    return moto_s3.client(
        "s3", access.access_key_id, access.secret_access_key, access.session_token
    )


def denied(call: Any) -> str:
    with pytest.raises(botocore.exceptions.ClientError) as info:
        call()
    return str(info.value.response["Error"]["Code"])


def checkpoint_store(access: StorageAccess, job_id: str) -> S3Store:
    """The checkpoint SDK's store at the place a learner of the job opens it (the backup
    URL plus `<job>/<learner>`), with the job's credentials only."""
    bucket, _, prefix = access.checkpoint_url.removeprefix("s3://").partition("/")
    return S3Store(bucket, f"{prefix}/{job_id}/learner-0", client=s3_client(access))


def test_job_credentials_reach_their_own_objects_only(
    store: S3ObjectStore, moto_s3: MotoS3, tmp_path: Path
) -> None:
    store.put("models/ja.zip", b"code of A")
    store.put("models/jb.zip", b"code of B")
    a = store.grant("ja", with_model=True, ttl_s=3600)
    b = store.grant("jb", with_model=True, ttl_s=3600)
    client_a = job_client(moto_s3, a)

    # Its own code, and checkpoints through the checkpoint SDK's store.
    body = client_a.get_object(Bucket=a.bucket, Key=a.model_key)["Body"].read()
    assert body == b"code of A"
    payload = tmp_path / "model.pt"
    payload.write_bytes(b"weights")
    mine = checkpoint_store(a, "ja")
    committed = mine.commit(payload, step=3, kind=CheckpointKind.PERIODIC)
    assert [c.step for c in mine.list_committed()] == [3]
    restored = mine.fetch(committed, tmp_path / "restored")
    assert restored.read_bytes() == b"weights"
    # Garbage collection deletes with the job's credentials too.
    mine.commit(payload, step=4, kind=CheckpointKind.PERIODIC)
    mine.keep_periodic = 0
    assert [c.step for c in mine.collect_garbage()] == [3]
    assert [c.step for c in mine.list_committed()] == [4]

    # B's checkpoint exists; A can neither read nor overwrite it, nor read B's code.
    theirs = checkpoint_store(b, "jb")
    theirs_ckpt = theirs.commit(payload, step=9, kind=CheckpointKind.PERIODIC)
    b_key = f"{theirs.prefix}/{theirs_ckpt.name}/model.pt"
    assert denied(lambda: client_a.get_object(Bucket=a.bucket, Key=b.model_key)) == "AccessDenied"
    assert denied(lambda: client_a.get_object(Bucket=a.bucket, Key=b_key)) == "AccessDenied"
    assert (
        denied(lambda: client_a.put_object(Bucket=a.bucket, Key=b_key, Body=b"evil"))
        == "AccessDenied"
    )
    assert denied(lambda: client_a.delete_object(Bucket=a.bucket, Key=b_key)) == "AccessDenied"
    # Nor anything the platform keeps outside the job's folders.
    assert (
        denied(lambda: client_a.put_object(Bucket=a.bucket, Key="elsewhere", Body=b"x"))
        == "AccessDenied"
    )
    assert store.s3.get_object(Bucket=a.bucket, Key=b_key)["Body"].read() == b"weights"


def test_a_job_without_code_gets_no_read_of_the_code_key(
    store: S3ObjectStore, moto_s3: MotoS3
) -> None:
    store.put("models/jc.zip", b"planted")
    access = store.grant("jc", with_model=False, ttl_s=3600)
    assert access.model_key == ""
    client = job_client(moto_s3, access)
    key = store.key("models/jc.zip")
    assert denied(lambda: client.get_object(Bucket=access.bucket, Key=key)) == "AccessDenied"


def test_revoke_stops_the_credentials_at_once(store: S3ObjectStore, moto_s3: MotoS3) -> None:
    store.put("models/jr.zip", b"code")
    access = store.grant("jr", with_model=True, ttl_s=3600)
    client = job_client(moto_s3, access)
    assert client.get_object(Bucket=access.bucket, Key=access.model_key)["Body"].read() == b"code"
    store.revoke("jr")
    store.revoke("jr")  # idempotent, as a rollback must be
    assert denied(lambda: client.get_object(Bucket=access.bucket, Key=access.model_key)) == (
        "AccessDenied"
    )
    key = f"{access.result_prefix}/0/out.txt"
    assert denied(lambda: client.put_object(Bucket=access.bucket, Key=key, Body=b"x")) == (
        "AccessDenied"
    )
    # The platform's own access is untouched: the refusal is the revocation's.
    assert store.get("models/jr.zip") == b"code"
    # A new grant for the same job (a deploy retry) works again.
    again = store.grant("jr", with_model=True, ttl_s=3600)
    assert job_client(moto_s3, again).get_object(Bucket=again.bucket, Key=again.model_key)
    store.revoke("never-granted")  # nothing to revoke: no error


def test_grants_expire_after_the_ttl(store: S3ObjectStore, moto_s3: MotoS3, tmp_path: Path) -> None:
    before = time.time()
    access = store.grant("je", with_model=True, ttl_s=1800)
    assert before + 1800 - 5 <= access.expires_at <= time.time() + 1800 + 5
    # STS's own bounds: at least 15 minutes, at most 12 hours.
    assert store.grant("je", with_model=True, ttl_s=1).expires_at <= time.time() + 900 + 5
    assert store.grant("je", with_model=True, ttl_s=10**6).expires_at <= time.time() + 43200 + 5
    # A learner handed expired credentials says so instead of failing obscurely.
    expired = StorageAccess(**{**access.to_dict(), "expires_at": time.time() - 1})
    with pytest.raises(CodeFetchError, match="credentials have expired"):
        download_archive(expired, tmp_path / "code.zip")
    assert not (tmp_path / "code.zip").exists()


def test_platform_objects_and_errors(store: S3ObjectStore, moto_s3: MotoS3) -> None:
    store.put("models/x.zip", b"x")
    assert store.exists("models/x.zip") and store.get("models/x.zip") == b"x"
    store.delete("models/x.zip")
    store.delete("models/x.zip")
    assert not store.exists("models/x.zip")
    with pytest.raises(ObjectNotFound, match=r"no object models/x\.zip"):
        store.get("models/x.zip")
    with pytest.raises(ObjectStoreError, match="must be a relative path"):
        store.put("../escape", b"x")
    with pytest.raises(ObjectStoreError, match="--object-store-endpoint"):
        open_object_store("s3://bucket", default_dir=Path("/nonexistent"))
    with pytest.raises(UnknownObjectStore, match="s3"):
        open_object_store("ftp://somewhere", default_dir=Path("/nonexistent"))
    stranger = S3ObjectStore("no-such-bucket", endpoint_url=moto_s3.url)
    with pytest.raises(ObjectStoreError, match="does not exist"):
        stranger.put("models/y.zip", b"y")


def test_volume_store_is_the_default(tmp_path: Path) -> None:
    store = open_object_store("", default_dir=tmp_path / "objects")
    assert not store.remote
    store.put("models/v.zip", b"v")
    assert (tmp_path / "objects" / "models" / "v.zip").read_bytes() == b"v"
    assert store.grant("v", with_model=True, ttl_s=60) is None
    assert list((tmp_path / "objects" / "models").iterdir()) == [
        tmp_path / "objects" / "models" / "v.zip"
    ]
