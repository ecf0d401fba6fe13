"""A real etcd with authentication on, for the tests of the platform's etcd users and
roles: each test module gets one of its own (tests/conftest.py `etcd_with_auth`), since
turning authentication on would lock the session's shared etcd's other users out."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from contract import etcd_keys
from contract.etcd import EtcdCredentials
from contract.etcd_users import enable_auth
from services.embedded.servers import EtcdServer

# etcd's root user (what the LCM holds) and the platform's own user, as `rhizome up` makes them
ROOT = EtcdCredentials("root", "root-pw-" + os.urandom(6).hex())
PLATFORM = EtcdCredentials("rhizome", "platform-pw-" + os.urandom(6).hex())


@contextlib.contextmanager
def etcd_with_auth(data_dir: Path) -> Iterator[str]:
    """Start an etcd in `data_dir`, turn authentication on (ROOT, PLATFORM over the
    platform's prefix), yield its URL; stopped by process id on the way out."""
    server = EtcdServer(data_dir)
    server.start()
    try:
        enable_auth(server.url, ROOT, PLATFORM, etcd_keys.ROOT + "/")
        yield server.url
    finally:
        server.stop()
