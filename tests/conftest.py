"""Session-scoped real servers for integration tests: free ports, temp dirs, stopped by pid."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.embedded.process import ManagedServer
from services.embedded.servers import ElasticsearchServer, EtcdServer, MongoServer

# As root the local backend runs each job's learners under a uid of its own, which must be
# able to enter the data directory; pytest's temp directories are 0700, and most tests'
# learners write beside them. Those tests run learners as the test's user; the isolation
# tests (tests/integration/test_isolation.py) turn it back on with a data directory others
# may traverse. An explicit setting in the environment wins.
os.environ.setdefault("RHIZOME_LEARNER_UIDS", "off")


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


@pytest.fixture
def stores(etcd_server: ManagedServer, mongo_server: ManagedServer) -> Iterator[dict[str, Any]]:
    """The lifecycle tests' view of the real stores: the jobs repository, an etcd client
    and both URLs (for the guardians and daemons the tests start)."""
    from contract.etcd import EtcdClient
    from services.store.jobs import JobsRepository
    from services.store.mongo import connect

    repo = JobsRepository(connect(mongo_server.url))
    repo.ensure_indexes()
    etcd = EtcdClient.connect(etcd_server.url)
    yield {"repo": repo, "etcd": etcd, "etcd_url": etcd_server.url, "mongo_url": mongo_server.url}
    etcd.close()
