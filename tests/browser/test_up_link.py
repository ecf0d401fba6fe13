"""`rhizome up --embedded` prints the dashboard's URL with a one-time login link for the
local admin, and that link signs a real Chromium in (once). The whole embedded platform
(etcd, MongoDB-wire, Elasticsearch-API servers and the daemon) is started by the CLI and
stopped by `rhizome down`, by pid."""

from __future__ import annotations

import re
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import expect

from tests.browser.conftest import Tab
from tests.integration.test_cli import rz

pytestmark = pytest.mark.integration


def test_up_prints_a_one_time_login_link_that_signs_the_admin_in(
    tab: Tab, tmp_path_factory: pytest.TempPathFactory
) -> None:
    data_dir = Path(tmp_path_factory.mktemp("up-link"))
    up = rz(data_dir, "up", "--embedded", "--grpc-port", "0", "--rest-port", "0")
    try:
        found = re.search(r"dashboard (\S+)/ — sign in once with (\S+/login/once/\S+)", up.stderr)
        assert found, f"no dashboard link in the output of `rhizome up`:\n{up.stderr}"
        # `up` serves TLS by default with its own CA: the gateway proves it holds a
        # certificate of that CA, then the browser (which does not know the CA) is told
        # to accept it, as a user importing ca.pem would.
        assert found.group(1).startswith("https://")
        ca = data_dir / "tls" / "ca.pem"
        assert str(ca) in up.stderr, "up must say which CA to import into the browser"
        httpx.get(found.group(1) + "/healthz", verify=ssl.create_default_context(cafile=ca))
        context = tab.page.context.browser.new_context(ignore_https_errors=True)
        page = context.new_page()

        def console_error(msg: Any) -> None:
            if msg.type == "error":
                tab.errors.append(msg.text)

        page.on("console", console_error)
        tab.page = page
        page.goto(found.group(2))
        page.get_by_role("button", name="Continue to the dashboard").click()
        expect(page.locator("h1")).to_have_text("All jobs")
        assert page.url == found.group(1) + "/"
        tab.screenshot("signed-in-by-link")
        tab.assert_no_console_errors()
    finally:
        rz(data_dir, "down", check=False)
