"""The REST gateway's HTTP protocol over TLS: one TLS record per response, not two.

uvicorn's HTTP protocols write a response as separate transport writes (status line and
headers, then the body; a chunked response's end is a third). Over TLS each write goes through asyncio's `SSLProtocol`:
Python code per write, an `SSLObject.write` (one TLS record, and a release and re-take of
the GIL, which the daemon's gRPC and worker threads contend for) and a socket send. The
profile of REST submits over TLS (benchmarks/RESULTS.md, issue #15) put most of TLS's
cost on the gateway's thread in these writes. This protocol hands uvicorn a transport
that gathers the writes of one event-loop step and passes them on as one write at the end
of that step (`loop.call_soon`): same bytes, same order, one record and one send.

Only the writes are gathered: reading, flow control (pause/resume), the peer's address and
TLS details pass through to the real transport, and closing sends what is gathered first.
Plaintext needs none of it (a socket send per write is all a plain write costs) and is
served by rest_http.py's protocol as it is.
"""

from __future__ import annotations

import asyncio
from typing import Any

from services.api.rest_http import RestHttpProtocol


class GatheringTransport:
    """An asyncio transport whose writes made in one event-loop step leave as one."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def flush(self) -> None:
        if not self._pending:
            return
        data = b"".join(self._pending)
        self._pending.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        # Everything else (get_extra_info, is_closing, pause/resume_reading, abort,
        # set_protocol...) is the real transport's.
        return getattr(self._transport, name)


class GatheringRestHttpProtocol(RestHttpProtocol):
    """The gateway's HTTP protocol (rest_http.py), writing through a `GatheringTransport`
    (see the module)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        gathering = GatheringTransport(transport, self.loop)  # type: ignore[arg-type]
        super().connection_made(gathering)  # type: ignore[arg-type]
