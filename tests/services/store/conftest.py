"""Fixtures of the store tests: a database on each real MongoDB-wire server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.embedded.servers import MongoServer
from services.store.mongo import connect

# Both servers the platform supports: a repository's queries and indexes must behave
# the same on each, so these tests run once per server.
MONGO_FLAVOURS = ["secantus", "nx-27017"]


@pytest.fixture(scope="module", params=MONGO_FLAVOURS)
def flavoured_db(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """A database on a fresh server of each flavour, shared by the module's tests."""
    server = MongoServer(
        Path(tmp_path_factory.mktemp(f"mongo-{request.param}")), flavour=request.param
    )
    server.start()
    try:
        database = connect(server.url)
        yield database
        database.client.close()
    finally:
        server.stop()
