"""An in-process daemon hosting the API against the real MongoDB-wire server.

Callers authenticate as the platform's users do, with bearer tokens: `api.token(user)`
mints one (straight into the token store, as an admin's `rhizome token create` would) and
`api.client(user)` is an SDK client carrying it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from rhizome.v1 import job_pb2

from services.client.sdk import Client
from services.daemon import Daemon
from services.embedded.process import ManagedServer
from services.store.tokens import TokensRepository
from tests.daemons import start_daemon


@dataclass
class RunningApi:
    grpc: str
    rest: str
    data_dir: Path
    daemon: Daemon
    tokens: TokensRepository
    _minted: dict[tuple[str, str], str] = field(default_factory=dict)

    def token(self, user: str, role: str = "user") -> str:
        """A token acting as `user` (one per user and role, reused)."""
        key = (user, role)
        if key not in self._minted:
            self._minted[key] = self.tokens.create(user, role, created_by="tests").secret
        return self._minted[key]

    def client(self, user: str, role: str = "user", **kwargs: Any) -> Client:
        return Client(self.grpc, token=self.token(user, role), **kwargs)

    def headers(self, user: str, role: str = "user") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token(user, role)}"}


def start_api(mongo_url: str, data_dir: Path, **config: Any) -> RunningApi:
    """A daemon hosting the API alone; `config` overrides PlatformConfig fields."""
    daemon = start_daemon(data_dir, mongo_url, **{"services": ("api",), **config})
    from services.store.mongo import connect

    tokens = TokensRepository(connect(mongo_url))
    return RunningApi(
        daemon.config.grpc_address,
        f"http://{daemon.config.rest_address}",
        data_dir,
        daemon,
        tokens,
    )


@pytest.fixture(scope="module")
def api(
    mongo_server: ManagedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningApi]:
    running = start_api(mongo_server.url, Path(tmp_path_factory.mktemp("daemon")))
    try:
        yield running
    finally:
        running.daemon.stop()


def mint_token(mongo_url: str, user: str, role: str = "user") -> str:
    """A token for `user` in the token store at `mongo_url` (the database in its path)."""
    from services.store.mongo import connect

    db = connect(mongo_url)
    try:
        return TokensRepository(db).create(user, role, created_by="tests").secret
    finally:
        db.client.close()


def token_client(daemon: Daemon, user: str, role: str = "user", **kwargs: Any) -> Client:
    """An SDK client of `daemon`'s API authenticated as `user`."""
    token = mint_token(daemon.config.mongodb_uri, user, role)
    return Client(daemon.config.grpc_address, token=token, **kwargs)


def wait_job_status(client: Client, job_id: str, status: int, timeout_s: float = 20) -> job_pb2.Job:
    """Poll the job until it has `status`; on time-out, say what it is instead."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get_job(job_id)
        if job.status == status:
            return job
        time.sleep(0.1)
    raise AssertionError(
        f"{job_id} is {job_pb2.JobStatus.Name(job.status)}, expected {job_pb2.JobStatus.Name(status)}"
    )
