"""A TCP relay for tests that cut or stall a client's connection to a real server.

127.0.0.1:<port> -> 127.0.0.1:<target>, bytes both ways, until ``cut()`` (every connection
closed, new ones refused) or ``stall()`` (connections kept, no byte forwarded);
``restore()`` / ``resume()`` undo them. A disconnect made this way is a real one: the
client's own reconnection, backoff and stream recovery run as they would against a
server that went away.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class Relay:
    """127.0.0.1:<port> -> the target port, bytes both ways, until ``cut()``."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open = True
        self.flowing = threading.Event()  # cleared by stall(): bytes are held, not lost
        self.flowing.set()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open:
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                self.flowing.wait()
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.open = False
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def restore(self) -> None:
        self.open = True

    def stall(self) -> None:
        """The server stops answering: connections stay up, nothing gets through."""
        self.flowing.clear()

    def resume(self) -> None:
        self.flowing.set()

    def close(self) -> None:
        self.resume()
        self.cut()
        self.listener.close()
