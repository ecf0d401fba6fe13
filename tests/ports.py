"""A port held by another process's listener (the test's own socket): what takes a port
between a server's pick and its bind, for the tests of how that is survived."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def listening_on(port: int = 0) -> Iterator[int]:
    """Listen on 127.0.0.1:`port` (0: any free one) for the block; yields the port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        yield int(sock.getsockname()[1])
