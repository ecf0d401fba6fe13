from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from services.embedded.process import ManagedServer
from services.store.etcd import EtcdStore
from services.store.jobs import JobsRepository
from services.store.mongo import connect


@pytest.fixture
def stores(etcd_server: ManagedServer, mongo_server: ManagedServer) -> Iterator[dict[str, Any]]:
    repo = JobsRepository(connect(mongo_server.url))
    repo.ensure_indexes()
    etcd = EtcdStore.connect(etcd_server.url)
    yield {"repo": repo, "etcd": etcd, "etcd_url": etcd_server.url, "mongo_url": mongo_server.url}
    etcd.close()
