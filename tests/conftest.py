"""Session-scoped real servers for integration tests: free ports, temp dirs, stopped by pid."""

from __future__ import annotations

import atexit
import faulthandler
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.embedded.process import ManagedServer
from services.embedded.servers import ElasticsearchServer, EtcdServer, MongoServer
from tests import etcd_auth

# As root the local backend runs each job's learners under a uid of its own, which must be
# able to enter the data directory; pytest's temp directories are 0700, and most tests'
# learners write beside them. Those tests run learners as the test's user; the isolation
# tests (tests/integration/test_isolation.py) turn it back on with a data directory others
# may traverse. An explicit setting in the environment wins.
os.environ.setdefault("RHIZOME_LEARNER_UIDS", "off")

# Learner uid claims are also marked machine-wide (services/backends/local/isolation.py,
# `/var/lib/rhizome-uid-claims`); the session's platforms keep their marks in a directory
# of the session's own, removed at exit, so a test run leaves nothing in /var/lib.
_UID_MARKS = tempfile.mkdtemp(prefix="rhizome-test-uid-marks-")
atexit.register(shutil.rmtree, _UID_MARKS, True)
os.environ.setdefault("RHIZOME_MACHINE_UID_CLAIMS", _UID_MARKS)


# After the summary, the interpreter waits for every non-daemon thread a test left (and
# for every thread-pool task still running). One stuck there once kept a CI run waiting
# 65 minutes after its last test, until CI killed it with no word of why. So the end is
# bounded: if the process still runs 3 minutes after pytest is done, every thread's stack
# goes to stderr and it exits 1. (A daemon thread: it runs while the interpreter waits for
# the others. It writes to fd 2 as it is then: pytest's capture has given it back.)
_SHUTDOWN_BOUND_S = 180


def _fail_a_stuck_exit() -> None:
    time.sleep(_SHUTDOWN_BOUND_S)
    stderr = sys.__stderr__ or sys.stderr
    print(
        f"\npytest ended {_SHUTDOWN_BOUND_S} s ago, but threads a test left keep this process"
        " from exiting; their stacks:",
        file=stderr,
        flush=True,
    )
    faulthandler.dump_traceback(file=stderr, all_threads=True)
    stderr.flush()
    os._exit(1)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    threading.Thread(target=_fail_a_stuck_exit, name="exit-bound", daemon=True).start()


# The session's servers that are running, by name: the per-module reset below empties
# only those, and starts none.
_RUNNING: dict[str, ManagedServer] = {}


def _serve(server: ManagedServer) -> Iterator[ManagedServer]:
    server.start()
    _RUNNING[server.name] = server
    try:
        yield server
    finally:
        _RUNNING.pop(server.name, None)
        server.stop()


@pytest.fixture(scope="module", autouse=True)
def _empty_session_stores_per_module() -> Iterator[None]:
    """Each test module starts from an empty MongoDB and etcd. The servers live for the
    whole session, and a daemon a module starts adopts every job it finds: jobs an earlier
    module left QUEUED or PROCESSING would be scheduled, deployed and guarded again, ahead
    of this module's own (in a full run one Kubernetes test waited 100 s behind them).
    Within a module, tests share what their module-scoped fixtures set up."""
    mongo = _RUNNING.get(MongoServer.name)
    if mongo is not None:
        from services.store.mongo import connect

        client = connect(mongo.url).client
        try:
            for name in client.list_database_names():
                if name not in ("admin", "config", "local"):
                    client.drop_database(name)
        finally:
            client.close()
    etcd = _RUNNING.get(EtcdServer.name)
    if etcd is not None:
        from contract.etcd import EtcdClient

        store = EtcdClient.connect(etcd.url)
        try:
            # etcd refuses an empty key, so "every key" is one range per first character
            firsts = {meta.key[:1] for _, meta in store.raw.get_all(keys_only=True)}
            for first in firsts:
                store.raw.delete_prefix(first)
        finally:
            store.close()
    yield


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


@pytest.fixture(scope="module")
def etcd_with_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real etcd of the module's own with authentication on (tests/etcd_auth.py: its
    ROOT and PLATFORM users); the URL."""
    with etcd_auth.etcd_with_auth(Path(tmp_path_factory.mktemp("etcd-auth"))) as url:
        yield url


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
