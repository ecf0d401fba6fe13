"""`rhizome up --standby` (issue #18): the platform runs a hot standby beside
the active daemon, the CLI's default API address lists both, and after a SIGKILL of the
active daemon the same CLI commands are answered by the standby. `rhizome down` stops
both. Real etcd, MongoDB-wire and Elasticsearch-API servers (the session's, so only the
two daemons start here), daemons started by `up` and stopped by pid by `down`."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from contract.procs import pid_alive
from services.embedded.process import ManagedServer
from tests.services.client.test_cli_platform import rz

pytestmark = pytest.mark.integration


def test_up_standby_lists_both_daemons_and_the_cli_fails_over(
    etcd_server: ManagedServer,
    mongo_server: ManagedServer,
    es_server: ManagedServer,
    tmp_path: Path,
) -> None:
    data = tmp_path / "platform"
    stores = [
        f"--etcd={etcd_server.url}",
        f"--mongodb-uri={mongo_server.url.replace('/?', '/cli_standby?')}",
        f"--elasticsearch-url={es_server.url}",
    ]
    up = ["up", *stores, "--standby", "--grpc-port", "0", "--rest-port", "0"]
    rz(*up, "--data-dir", str(data))
    try:
        state = json.loads((data / "platform.json").read_text())
        active, warm = state["processes"]["api"], state["processes"]["api-standby"]
        assert "--standby" in warm["argv"] and "--standby" not in active["argv"]
        before = json.loads(rz("list", "--json", "--data-dir", str(data)).stdout)

        os.kill(int(active["pid"]), signal.SIGKILL)
        # The CLI's default address is `ACTIVE,STANDBY`: it goes on to the standby.
        after = json.loads(rz("list", "--json", "--data-dir", str(data)).stdout)
        assert after == before
    finally:
        rz("down", "--data-dir", str(data), check=False)
    state = json.loads((data / "platform.json").read_text())
    assert state["processes"] == {}
    assert not pid_alive(int(warm["pid"]))
