"""The REST gateway's TLS protocol (services/api/tls_writes.py): the writes of one
event-loop step leave as one, in order, and nothing is lost at close; and uvicorn serving
it over real TLS answers plain, streamed and malformed requests on one kept-alive
connection as its own protocol does."""

from __future__ import annotations

import asyncio
import ssl
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from contract.procs import free_port
from services.api.tls_writes import GatheringRestHttpProtocol, GatheringTransport
from services.embedded.platform import TlsChoice


class RecordingTransport:
    """The part of an asyncio transport the gathering one calls, recording writes."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return f"extra:{name}"


def test_the_writes_of_one_step_leave_as_one_in_order() -> None:
    async def scenario() -> RecordingTransport:
        real = RecordingTransport()
        gathering = GatheringTransport(real, asyncio.get_running_loop())  # type: ignore[arg-type]
        gathering.write(b"HTTP/1.1 200 OK\r\n\r\n")
        gathering.write(b"")  # nothing to send: no write
        gathering.writelines([b"body-", bytearray(b"1")])
        assert real.writes == []  # not before the step ends
        await asyncio.sleep(0)
        gathering.write(b"body-2")  # a later step: its own write
        await asyncio.sleep(0)
        gathering.write(b"last")
        gathering.close()  # sends what is gathered before closing
        assert gathering.get_extra_info("peername") == "extra:peername"
        return real

    real = asyncio.run(scenario())
    assert real.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody-1", b"body-2", b"last"]
    assert real.closed


@pytest.fixture(scope="module")
def tls_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ssl.SSLContext]]:
    async def job(request: Request) -> JSONResponse:
        return JSONResponse({"id": request.path_params["id"], "pad": "x" * 20_000})

    async def follow(request: Request) -> StreamingResponse:
        async def lines() -> AsyncIterator[bytes]:
            for i in range(3):
                yield f"line {i}\n".encode()
                await asyncio.sleep(0.01)

        return StreamingResponse(lines(), media_type="text/plain")

    app = Starlette(routes=[Route("/jobs/{id}", job), Route("/follow", follow)])
    tls = TlsChoice(plaintext=False).prepare(Path(tmp_path_factory.mktemp("tls")))
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        ssl_certfile=tls.cert,
        ssl_keyfile=tls.key,
        http=GatheringRestHttpProtocol,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    try:
        yield f"https://127.0.0.1:{port}", ssl.create_default_context(cafile=tls.ca)
    finally:
        server.should_exit = True
        thread.join(timeout=5)


def test_uvicorn_over_tls_answers_through_it_on_one_connection(
    tls_gateway: tuple[str, ssl.SSLContext],
) -> None:
    url, context = tls_gateway
    stats = context.session_stats()["connect"]
    with httpx.Client(base_url=url, verify=context) as client:
        for i in range(3):
            answer = client.get(f"/jobs/j{i}")
            assert answer.status_code == 200
            assert answer.json() == {"id": f"j{i}", "pad": "x" * 20_000}
        with client.stream("GET", "/follow") as streamed:
            assert list(streamed.iter_lines()) == ["line 0", "line 1", "line 2"]
        assert client.get("/nowhere").status_code == 404
    assert context.session_stats()["connect"] - stats == 1  # one kept-alive connection


def test_a_malformed_request_over_tls_gets_uvicorns_400_and_a_close(
    tls_gateway: tuple[str, ssl.SSLContext],
) -> None:
    import socket

    url, context = tls_gateway
    port = int(url.rsplit(":", 1)[1])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as conn,
    ):
        conn.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400 ")
