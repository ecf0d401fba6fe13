"""The embedded dependencies start, answer, and stop by pid without leaving processes."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from contract.procs import pid_alive
from services.embedded.process import DependencyError
from services.embedded.servers import EtcdServer, MongoServer


@pytest.mark.integration
def test_etcd_starts_answers_and_stops_by_pid(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path)
    info = server.start()
    with urllib.request.urlopen(f"{info.url}/health", timeout=2) as resp:
        assert b"true" in resp.read()
    server.stop()
    assert not pid_alive(info.pid)


@pytest.mark.integration
def test_mongo_stops_by_pid_after_a_clean_shutdown_that_kept_its_data(tmp_path: Path) -> None:
    """`stop` wakes the server's accept loop (servers.waking_its_listener) so that it
    shuts down at once; the shutdown is still the server's own (SIGTERM): what was
    written is there after a restart on the same directory."""
    import pymongo

    server = MongoServer(tmp_path)
    info = server.start()
    client: pymongo.MongoClient[dict[str, object]] = pymongo.MongoClient(info.url)
    try:
        client.kept.docs.insert_one({"_id": "written", "n": 1})
    finally:
        client.close()
    server.stop()
    assert not pid_alive(info.pid)
    again = MongoServer(tmp_path)
    again.start()
    client = pymongo.MongoClient(again.url)
    try:
        assert client.kept.docs.find_one({"_id": "written"}) == {"_id": "written", "n": 1}
    finally:
        client.close()
        again.stop()


@pytest.mark.integration
def test_mongo_and_es_fixtures_answer(mongo_server: MongoServer, es_server: EtcdServer) -> None:
    assert mongo_server.healthy()
    assert es_server.healthy()


def test_a_dependency_that_cannot_start_is_named_with_its_log(tmp_path: Path) -> None:
    class Broken(EtcdServer):
        name = "broken-etcd"

        def argv(self) -> list[str]:
            return ["/bin/sh", "-c", "echo boom; exit 3"]

    with pytest.raises(DependencyError, match=r"broken-etcd exited with code 3.*broken-etcd\.log"):
        Broken(tmp_path).start()
