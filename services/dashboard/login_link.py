"""The one-time login link `rhizome up --embedded` prints for the local admin.

A client of the gateway's `POST /ui/login-links` (admin bearer token): kept free of the
dashboard's server-side imports, so the CLI pays only for httpx."""

from __future__ import annotations

import ssl
import time
from pathlib import Path

import httpx


def login_link(rest_url: str, token_file: Path, ca_file: str = "", timeout_s: float = 30.0) -> str:
    """The dashboard URL with a one-time code that signs a browser in as the token in
    `token_file`; raises OSError or httpx.HTTPError when it cannot be had.

    Waits up to `timeout_s` for the gateway to listen: the daemon reports healthy when its
    gRPC server serves, and starts the REST gateway just after. Over https the gateway's
    certificate must be signed by `ca_file` (the platform's own CA) or a system CA."""
    token = token_file.read_text().strip()
    verify: ssl.SSLContext | bool = True
    if ca_file:
        verify = ssl.create_default_context(cafile=ca_file)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            resp = httpx.post(
                f"{rest_url}/ui/login-links",
                headers={"Authorization": f"Bearer {token}"},
                timeout=10,
                verify=verify,
            )
            break
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)
    resp.raise_for_status()
    return f"{rest_url}{resp.json()['path']}"
