"""Session-scoped real servers for integration tests: free ports, temp dirs, stopped by pid."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.embedded.process import ManagedServer
from services.embedded.servers import ElasticsearchServer, EtcdServer, MongoServer


def _serve(server: ManagedServer) -> Iterator[ManagedServer]:
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedServer]:
    """A real etcd 3.5 on 127.0.0.1; `.url` is its client URL, `.port` its port."""
    yield from _serve(EtcdServer(Path(tmp_path_factory.mktemp("etcd"))))


@pytest.fixture(scope="session")
def mongo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedServer]:
    """A real MongoDB-wire server (RHIZOME_MONGO_SERVER picks secantus or nx-27017)."""
    yield from _serve(MongoServer(Path(tmp_path_factory.mktemp("mongo"))))


@pytest.fixture(scope="session")
def es_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedServer]:
    """A real Elasticsearch-API server (noida-db) on 127.0.0.1."""
    yield from _serve(ElasticsearchServer(Path(tmp_path_factory.mktemp("es"))))
