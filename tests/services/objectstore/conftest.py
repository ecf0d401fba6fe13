from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.services.objectstore.server import MotoS3


@pytest.fixture(scope="module")
def moto_s3() -> Iterator[MotoS3]:
    server = MotoS3().start()
    try:
        yield server
    finally:
        server.stop()
