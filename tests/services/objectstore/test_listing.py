"""`list_keys` and `put_file`, which the API's trained-model download and streamed
uploads use, on both stores: a volume, and S3 (moto's server, started by the fixture)."""

from __future__ import annotations

import io
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.objectstore.api import ObjectStore
from services.objectstore.s3 import S3ObjectStore
from services.objectstore.volume import VolumeStore
from tests.services.objectstore.server import MotoS3

pytestmark = pytest.mark.integration


@pytest.fixture(params=["volume", "s3"])
def store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ObjectStore]:
    if request.param == "volume":
        yield VolumeStore(tmp_path / "objects")
        return
    moto_s3: MotoS3 = request.getfixturevalue("moto_s3")
    for key, value in moto_s3.platform_env.items():
        monkeypatch.setenv(key, value)
    yield S3ObjectStore(moto_s3.bucket, f"p-{uuid.uuid4().hex[:6]}", endpoint_url=moto_s3.url)


def test_list_keys_names_every_object_under_a_folder_only(store: ObjectStore) -> None:
    store.put("results/job-a/0/model.pt", b"w")
    store.put("results/job-a/1/sub/metrics.json", b"{}")
    store.put("results/job-ab/0/other.pt", b"x")  # a job id that starts the same
    store.put("models/job-a.zip", b"z")
    assert store.list_keys("results/job-a") == [
        "results/job-a/0/model.pt",
        "results/job-a/1/sub/metrics.json",
    ]
    assert store.list_keys("results/nothing") == []


def test_put_file_stores_from_the_files_position(store: ObjectStore) -> None:
    data = os.urandom(3 * 1024 * 1024)
    source = io.BytesIO(b"skip" + data)
    source.seek(4)
    store.put_file("models/big.zip", source)
    assert store.get("models/big.zip") == data


def test_a_volume_lists_no_links_and_no_temporary_files(tmp_path: Path) -> None:
    store = VolumeStore(tmp_path / "objects")
    store.put("results/j/0/a.txt", b"a")
    folder = tmp_path / "objects" / "results" / "j" / "0"
    (folder / "link").symlink_to("/etc/hostname")
    (folder / ".a.txt.tmp-1").write_bytes(b"half")
    assert store.list_keys("results/j") == ["results/j/0/a.txt"]
