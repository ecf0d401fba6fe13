"""The browser tests' platform and browser: a daemon hosting every service (api,
scheduler, lcm, tds) against the session's real etcd, MongoDB-wire and
Elasticsearch-API servers, and Debian's headless Chromium driven by playwright.

Chromium comes from `make install` (apt, as root); playwright's own browser download is
never used. Each test gets a fresh browser context at 1280×800 that records console
errors, and leaves a screenshot in its tmp_path."""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from services.client.sdk import Client
from services.daemon import Daemon
from services.embedded.process import ManagedServer
from services.store.tokens import TokensRepository
from tests.daemons import running_daemon

CHROMIUM_ARGS = ["--no-sandbox", "--disable-background-networking"]
INSTALL_CHROMIUM = (
    "chromium is not installed, and the browser tests drive Debian's chromium: run "
    "`make install` as root, or `sudo apt-get install chromium`"
)


@dataclass
class Platform:
    url: str  # the REST gateway, where the dashboard is
    daemon: Daemon
    tokens: TokensRepository
    _minted: dict[tuple[str, str], str] = field(default_factory=dict)

    def token(self, user: str, role: str = "user") -> str:
        if (user, role) not in self._minted:
            self._minted[(user, role)] = self.tokens.create(user, role, created_by="tests").secret
        return self._minted[(user, role)]

    def client(self, user: str, role: str = "user") -> Client:
        return Client(self.daemon.config.grpc_address, token=self.token(user, role))


@pytest.fixture(scope="session")
def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail(INSTALL_CHROMIUM)
    return path


@pytest.fixture(scope="module")
def platform(
    etcd_server: ManagedServer,
    mongo_server: ManagedServer,
    es_server: ManagedServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Platform]:
    data_dir, uri = module_data(mongo_server, tmp_path_factory, "dashboard")
    from services.store.mongo import connect

    with running_daemon(data_dir, uri, etcd=etcd_server, es=es_server) as daemon:
        yield Platform(
            f"http://{daemon.config.rest_address}", daemon, TokensRepository(connect(uri))
        )


def module_data(
    mongo_server: ManagedServer, tmp_path_factory: pytest.TempPathFactory, name: str
) -> tuple[Path, str]:
    """A module's data directory and the URI of a database of its own, named after it:
    other modules' queued jobs must not compete for its cluster."""
    data_dir = Path(tmp_path_factory.mktemp(name))
    return data_dir, mongo_server.url.replace("/?", f"/{data_dir.name.replace('.', '_')}?")


@pytest.fixture(scope="module")
def browser(chromium_path: str) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@dataclass
class Tab:
    """A page with the console errors it logged."""

    page: Any
    errors: list[str]
    shots: Path

    def screenshot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def assert_no_console_errors(self, allowed: Callable[[str], bool] = lambda _: False) -> None:
        bad = [e for e in self.errors if not allowed(e)]
        assert not bad, f"console errors: {bad}"


@pytest.fixture
def tab(browser: Any, tmp_path: Path) -> Iterator[Tab]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.set_default_timeout(30_000)
    found = Tab(page, [], tmp_path)

    def console_error(msg: Any) -> None:
        if msg.type == "error":
            found.errors.append(msg.text)

    page.on("console", console_error)
    page.on("pageerror", lambda exc: found.errors.append(f"uncaught: {exc}"))
    try:
        yield found
    finally:
        # Every test leaves what the page looked like at its end in its output directory.
        page.screenshot(path=str(tmp_path / "final.png"), full_page=True)
        context.close()


def sign_in(tab: Tab, platform: Platform, token: str, path: str = "/") -> None:
    """Sign in through the login page, with the keyboard as a user would."""
    page = tab.page
    page.goto(platform.url + path)
    page.wait_for_url("**/login**")
    from playwright.sync_api import expect

    expect(page.locator("#token")).to_be_focused()  # the page opens with the focus there
    page.keyboard.type(token)
    page.keyboard.press("Enter")
    page.wait_for_url(lambda url: "/login" not in url)


def user_name() -> str:
    return f"u-{uuid.uuid4().hex[:6]}"


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"gave up waiting for {what}")
