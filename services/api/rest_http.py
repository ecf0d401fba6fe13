"""The REST gateway's HTTP protocol: uvicorn's httptools one (a C parser, llhttp), with
the API's error body on the one answer uvicorn writes itself.

A request the parser refuses (a malformed request line, a control character in a header
value, a broken chunk) never reaches the app; uvicorn answers it 400 in plain text. Every
other error of the API is JSON `{code, message}` (docs/api.md), so this protocol answers
that one so too, saying what to fix. The parser is strict on purpose (no leniencies):
a header h11 let through with a control character in it is refused here.
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

MALFORMED = (
    "the HTTP request is malformed (RFC 9112): check the request line and that no header "
    "value holds a control character"
)


class RestHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering a request its parser refuses in JSON."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps({"code": "bad_request", "message": MALFORMED}).encode()
        content = [STATUS_LINE[400]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend(
            [
                b"content-type: application/json\r\n",
                b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                b"connection: close\r\n",
                b"\r\n",
                body,
            ]
        )
        self.transport.write(b"".join(content))
        self.transport.close()
