"""`rhizome up --embedded` prints the dashboard's URL with a one-time login link for the
local admin, and that link signs a real Chromium in (once). The whole embedded platform
(etcd, MongoDB-wire, Elasticsearch-API servers and the daemon) is started by the CLI and
stopped by `rhizome down`, by pid."""

from __future__ import annotations

import re
from pathlib import Path

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
        page = tab.page
        page.goto(found.group(2))
        page.get_by_role("button", name="Continue to the dashboard").click()
        expect(page.locator("h1")).to_have_text("All jobs")
        assert page.url == found.group(1) + "/"
        tab.screenshot("signed-in-by-link")
        tab.assert_no_console_errors()
    finally:
        rz(data_dir, "down", check=False)
