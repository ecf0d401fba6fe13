"""The embedded dependencies start, answer, and stop by pid without leaving processes."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from contract.procs import free_port, pid_alive
from services.embedded.platform import DaemonServer, grpc_serving
from services.embedded.process import DependencyError, PortTaken
from services.embedded.servers import EtcdServer, MongoServer
from tests.ports import listening_on


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


@pytest.mark.integration
def test_a_server_whose_picked_port_was_taken_before_it_bound_starts_on_another(
    tmp_path: Path,
) -> None:
    """etcd says nothing but 'address already in use' and exit code 1: the port held by
    someone else now is what tells a taken port from any other failure."""
    server = EtcdServer(tmp_path)
    taken = server.port
    with listening_on(taken):
        info = server.start()
    try:
        assert info.port == server.port != taken
        assert server.healthy()
    finally:
        server.stop()


@pytest.mark.integration
def test_a_port_the_caller_gave_is_never_replaced_and_the_error_names_it(tmp_path: Path) -> None:
    port = free_port()
    server = EtcdServer(tmp_path, port=port)
    with listening_on(port), pytest.raises(PortTaken, match=rf"port it was to listen on \({port}"):
        server.start()
    assert server.port == port
    assert server.pid is not None and not pid_alive(server.pid)  # nothing left behind


@pytest.mark.integration
def test_a_daemon_whose_rest_port_was_taken_is_started_on_other_ports(
    tmp_path: Path, mongo_server: MongoServer
) -> None:
    """The daemon exits with ExitCode.PORT_IN_USE; `rhizome up` and the test platforms set
    `repick` where the ports are their own choice (services/embedded/platform.py)."""
    daemon = DaemonServer(
        tmp_path,
        free_port(),
        free_port(),
        [f"--mongodb-uri={mongo_server.url}", "--services=api"],
        metrics_port=free_port(),
    )
    daemon.repick = True
    first = (daemon.port, daemon.rest_port, daemon.metrics_port)
    with listening_on(daemon.rest_port):
        daemon.start()
    try:
        assert daemon.rest_port != first[1] and daemon.port != first[0]
        assert grpc_serving(daemon.url)
        assert f"--rest-address=127.0.0.1:{daemon.rest_port}" in daemon.argv()
        log = daemon.log_path.read_text()
        assert f"could not listen on 127.0.0.1:{first[1]}: the port is in use" in log
    finally:
        daemon.stop()
