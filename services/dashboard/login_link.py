"""The one-time login link `rhizome up --embedded` prints for the local admin.

A client of the gateway's `POST /ui/login-links` (admin bearer token): kept free of the
dashboard's server-side imports, so the CLI pays only for httpx."""

from __future__ import annotations

from pathlib import Path

import httpx


def login_link(rest_url: str, token_file: Path, timeout_s: float = 10.0) -> str:
    """The dashboard URL with a one-time code that signs a browser in as the token in
    `token_file`; raises OSError or httpx.HTTPError when it cannot be had."""
    token = token_file.read_text().strip()
    resp = httpx.post(
        f"{rest_url}/ui/login-links",
        headers={"Authorization": f"Bearer {token}"},
        timeout=timeout_s,
    )
    resp.raise_for_status()
    return f"{rest_url}{resp.json()['path']}"
