"""An in-process daemon hosting the API against the real MongoDB-wire server."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from contract.procs import free_port
from services.config import PlatformConfig
from services.daemon import Daemon
from services.embedded.process import ManagedServer


@dataclass
class RunningApi:
    grpc: str
    rest: str
    data_dir: Path
    daemon: Daemon


@pytest.fixture(scope="module")
def api(
    mongo_server: ManagedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningApi]:
    data_dir = Path(tmp_path_factory.mktemp("daemon"))
    config = PlatformConfig(
        data_dir=data_dir,
        mongodb_uri=mongo_server.url,
        services=("api",),
        grpc_address=f"127.0.0.1:{free_port()}",
        rest_address=f"127.0.0.1:{free_port()}",
    )
    daemon = Daemon(config)
    daemon.start()
    try:
        yield RunningApi(config.grpc_address, f"http://{config.rest_address}", data_dir, daemon)
    finally:
        daemon.stop()
