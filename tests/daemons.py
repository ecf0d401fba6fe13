"""An in-process platform daemon for tests, on free loopback ports, against the real
servers the session's fixtures started (tests/conftest.py): the one way tests build one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from contract.procs import free_port
from services.config import PlatformConfig
from services.daemon import Daemon
from services.embedded.process import ManagedServer


def own_database(data_dir: Path) -> str:
    """A MongoDB database named after `data_dir`, for a test whose jobs must not meet
    other tests' (reservations and queues are cluster-wide)."""
    return data_dir.name.replace(".", "_")


def daemon_config(
    data_dir: Path,
    mongo: ManagedServer | str,
    *,
    database: str | None = None,
    etcd: ManagedServer | str | None = None,
    es: ManagedServer | None = None,
    **config: Any,
) -> PlatformConfig:
    """The config of a test daemon: `database` (in the MongoDB URI's path) when given,
    etcd and Elasticsearch when given, gRPC and REST on free ports, no metrics port;
    `config` sets or overrides any other PlatformConfig field."""
    uri = mongo if isinstance(mongo, str) else mongo.url
    if database is not None:
        uri = uri.replace("/?", f"/{database}?")
    settings: dict[str, Any] = {
        "data_dir": data_dir,
        "mongodb_uri": uri,
        "grpc_address": f"127.0.0.1:{free_port()}",
        "rest_address": f"127.0.0.1:{free_port()}",
        "metrics_address": "",
    }
    if etcd is not None:
        settings["etcd_url"] = etcd if isinstance(etcd, str) else etcd.url
    if es is not None:
        settings["elasticsearch_url"] = es.url
    return PlatformConfig(**{**settings, **config})


def start_daemon(data_dir: Path, mongo: ManagedServer | str, **kwargs: Any) -> Daemon:
    """A started daemon (arguments as for `daemon_config`); the caller stops it."""
    daemon = Daemon(daemon_config(data_dir, mongo, **kwargs))
    daemon.start()
    return daemon


@contextlib.contextmanager
def running_daemon(data_dir: Path, mongo: ManagedServer | str, **kwargs: Any) -> Iterator[Daemon]:
    """`start_daemon`, stopped when the block ends however it ends."""
    daemon = start_daemon(data_dir, mongo, **kwargs)
    try:
        yield daemon
    finally:
        daemon.stop()
