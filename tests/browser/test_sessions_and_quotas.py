"""The dashboard across a daemon restart, and the Cluster page's quotas: a daemon of this
module's own (every service, over the session's real etcd, MongoDB-wire and
Elasticsearch-API servers) with a quota configuration, restarted in the middle of a test
(tests/browser/conftest.py has the shared parts)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import expect
from rhizome.v1 import job_pb2

from contract.procs import free_port
from services.config import PlatformConfig
from services.daemon import Daemon
from services.embedded.process import ManagedServer
from services.store.mongo import connect
from services.store.tokens import TokensRepository
from tests.browser.conftest import Platform, Tab, module_data, sign_in, user_name, wait_until

pytestmark = pytest.mark.integration

QUOTA_USER = "quota-user"
QUOTAS = f"""borrowing: true
users:
  {QUOTA_USER}: {{quota: {{FAKE: 2}}, limit: {{FAKE: 6}}}}
"""
GPU_SLEEPER = (
    "name: borrower\nlearners: 2\ngpus: 2\ngpu_type: FAKE\ncpus: 1\nmemory: 128MiB\n"
    "framework:\n  command: python -c 'import time; time.sleep(600)'\n"
)


@pytest.fixture(scope="module")
def platform(
    etcd_server: ManagedServer,
    mongo_server: ManagedServer,
    es_server: ManagedServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Platform]:
    data_dir, uri = module_data(mongo_server, tmp_path_factory, "dashboard-restart")
    (data_dir / "quotas.yaml").write_text(QUOTAS)
    config = PlatformConfig(
        data_dir=data_dir,
        mongodb_uri=uri,
        etcd_url=etcd_server.url,
        elasticsearch_url=es_server.url,
        grpc_address=f"127.0.0.1:{free_port()}",
        rest_address=f"127.0.0.1:{free_port()}",
        metrics_address="",
        quota_config=str(data_dir / "quotas.yaml"),
    )
    daemon = Daemon(config)
    daemon.start()
    found = Platform(f"http://{config.rest_address}", daemon, TokensRepository(connect(uri)))
    try:
        yield found
    finally:
        found.daemon.stop()  # the daemon running now (a test may have restarted it)


def restart(platform: Platform) -> None:
    platform.daemon.stop()
    platform.daemon = Daemon(platform.daemon.config)
    platform.daemon.start()


def test_a_session_survives_a_daemon_restart_and_a_sign_out_survives_it_too(
    tab: Tab, platform: Platform
) -> None:
    page = tab.page
    sign_in(tab, platform, platform.token(user_name()))
    expect(page.locator("h1")).to_have_text("Your jobs")
    cookie = next(c for c in page.context.cookies() if c["name"] == "rz_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    restart(platform)
    page.goto(platform.url + "/")  # no sign-in page: the restarted daemon opens the cookie
    expect(page.locator("h1")).to_have_text("Your jobs")
    tab.screenshot("after-restart")
    page.get_by_role("button", name="Sign out").click()
    page.wait_for_url("**/login**")
    expect(page.locator("#login-message")).to_contain_text("signed out")
    # The signed-out cookie, kept by someone who copied it, is dead after a restart too.
    restart(platform)
    page.context.add_cookies([cookie])
    page.goto(platform.url + "/")
    page.wait_for_url("**/login**")
    expect(page.locator("#login-message")).to_contain_text("This session was signed out")
    # An altered cookie is a sign-in page with a message, not an error.
    page.context.add_cookies([{**cookie, "value": cookie["value"][:-4] + "AAAA"}])
    page.goto(platform.url + "/cluster")
    page.wait_for_url("**/login**")
    expect(page.locator("#login-message")).to_contain_text("not valid here any more")
    tab.assert_no_console_errors()


def test_the_cluster_page_shows_a_users_quota_and_what_they_borrow(
    tab: Tab, platform: Platform
) -> None:
    with platform.client(QUOTA_USER) as rz:
        job_id = rz.create_job(GPU_SLEEPER).job_id
        try:
            wait_until(
                lambda: rz.get_job(job_id).status == job_pb2.PROCESSING, "the borrower to run"
            )
            sign_in(tab, platform, platform.token(QUOTA_USER), "/cluster")
            row = tab.page.locator(f"#quotas tr[data-user='{QUOTA_USER}']")
            # quota 2 FAKE, limit 6; the job holds 2 learners x 2 GPUs: 4 in use, 2 borrowed
            expect(row.locator("td")).to_have_text([QUOTA_USER, "FAKE", "2", "6", "4", "2"])
            tab.screenshot("quotas")
            # Another user sees only their own line.
            other = user_name()
            tab.page.context.clear_cookies()
            sign_in(tab, platform, platform.token(other), "/cluster")
            expect(tab.page.locator(f"#quotas tr[data-user='{QUOTA_USER}']")).to_have_count(0)
            tab.assert_no_console_errors()
        finally:
            rz.delete_job(job_id)
