"""The web dashboard in a real headless Chromium against a daemon hosting every service
over real etcd, MongoDB-wire and Elasticsearch-API servers (tests/browser/conftest.py).

Each test leaves screenshots in its tmp_path and checks that the page logged no console
errors."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import expect
from rhizome.v1 import job_pb2

from services.client.sdk import Client
from tests.browser.conftest import Platform, Tab, sign_in, user_name, wait_until

pytestmark = pytest.mark.integration

SLEEPER = "name: {name}\nmemory: 128MiB\nframework:\n  command: python -c 'import time; time.sleep(600)'\n"
GPU_SLEEPER = (
    "name: {name}\nlearners: 2\ngpus: 2\ngpu_type: FAKE\ncpus: 1\nmemory: 128MiB\n"
    "framework:\n  command: python -c 'import time; time.sleep(600)'\n"
)


@contextlib.contextmanager
def _users_job(platform: Platform, manifest: str) -> Iterator[tuple[str, Client, str]]:
    """A new user, their client and a job of `manifest` they submitted, deleted at the end."""
    user = user_name()
    with platform.client(user) as rz:
        job_id = rz.create_job(manifest).job_id
        try:
            yield user, rz, job_id
        finally:
            rz.delete_job(job_id)


def page_overflow(page: Any) -> int:
    """How many pixels the page is wider than its window (0 or less: it fits)."""
    return int(
        page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
    )


def test_a_wrong_token_is_refused_and_an_expired_one_goes_back_to_the_login(
    tab: Tab, platform: Platform
) -> None:
    page = tab.page
    page.goto(platform.url + "/")
    page.wait_for_url("**/login**")
    page.fill("#token", "rz_not-a-token-anyone-made-0000000000")
    page.click("button[type=submit]")
    expect(page.locator("#login-message")).to_contain_text("That token was refused")
    assert "/login" in page.url
    assert not [c for c in page.context.cookies() if c["name"] == "rz_session"]
    tab.screenshot("wrong-token")

    # A token that expires while signed in sends the browser back to the login, saying so.
    secret = platform.tokens.create(user_name(), expires_at=time.time() + 3).secret
    sign_in(tab, platform, secret)
    expect(page.locator("h1")).to_have_text("Your jobs")
    time.sleep(3.5)
    page.reload()
    page.wait_for_url("**/login**")
    expect(page.locator("#login-message")).to_contain_text("expired")
    tab.screenshot("expired")
    tab.assert_no_console_errors(lambda e: "401" in e)


def test_a_queued_job_shows_why_it_waits_on_its_page_and_in_the_list(
    tab: Tab, platform: Platform
) -> None:
    user = user_name()
    with platform.client(user) as rz:
        first = rz.create_job(GPU_SLEEPER.format(name="holds-the-gpus")).job_id
        wait_until(lambda: rz.get_job(first).status != job_pb2.QUEUED, "the first job's placement")
        second = rz.create_job(GPU_SLEEPER.format(name="waits-for-gpus")).job_id
        try:
            sign_in(tab, platform, platform.token(user))
            page = tab.page
            row = page.locator(f"tr[data-job='{second}']")
            expect(row).to_contain_text("QUEUED")
            expect(row).to_contain_text("queued")
            row.get_by_role("link").click()
            why = page.locator("#why-waits")
            expect(why).to_be_visible()
            expect(why).to_contain_text("needs 2 learners × 2 FAKE")
            tab.screenshot("queued-job")
            # The Cluster page lists it in the queue, with the same reason.
            page.get_by_role("link", name="Cluster").click()
            queued = page.locator(f"#queue tr[data-job='{second}']")
            expect(queued).to_contain_text("waits-for-gpus")
            expect(queued).to_contain_text("needs 2 learners × 2 FAKE")
            tab.screenshot("cluster")
            tab.assert_no_console_errors()
        finally:
            rz.delete_job(second)
            rz.delete_job(first)


def test_halt_and_resume_from_the_job_page_after_confirming(tab: Tab, platform: Platform) -> None:
    with _users_job(platform, SLEEPER.format(name="halt-me")) as (user, rz, job_id):
        sign_in(tab, platform, platform.token(user), f"/jobs/{job_id}")
        page = tab.page
        expect(page.locator("#status")).to_have_text("PROCESSING", timeout=60_000)
        page.click("#btn-halt")
        dialog = page.locator("#confirm")
        expect(dialog).to_be_visible()
        # Cancelling does nothing.
        page.click("#confirm-cancel")
        expect(dialog).to_be_hidden()
        assert rz.get_job(job_id).status == job_pb2.PROCESSING
        page.click("#btn-halt")
        page.click("#confirm-ok")
        expect(page.locator("#outcome")).to_contain_text("halt done", timeout=60_000)
        expect(page.locator("#status")).to_have_text("HALTED")
        expect(page.locator("#btn-resume")).to_be_enabled()
        assert rz.get_job(job_id).status == job_pb2.HALTED
        tab.screenshot("halted")
        page.click("#btn-resume")
        page.click("#confirm-ok")
        expect(page.locator("#outcome")).to_contain_text("resume done")
        expect(page.locator("#status")).not_to_have_text("HALTED")
        expect(page.locator("#history")).to_contain_text("resume from the dashboard")
        assert rz.get_job(job_id).status != job_pb2.HALTED
        tab.screenshot("resumed")
        # A refused action shows the API's message: a second resume of a running job.
        page.evaluate("document.getElementById('btn-resume').disabled = false")
        page.click("#btn-resume")
        page.click("#confirm-ok")
        expect(page.locator("#outcome")).to_contain_text("only a HALTED job can be resumed")
        tab.assert_no_console_errors(lambda e: "409" in e)


def test_an_unknown_job_is_a_404_page_and_an_action_without_the_csrf_token_is_refused(
    tab: Tab, platform: Platform
) -> None:
    user = user_name()
    sign_in(tab, platform, platform.token(user))
    page = tab.page
    response = page.goto(platform.url + "/jobs/no-such-job")
    assert response is not None and response.status == 404
    expect(page.locator("h1")).to_have_text("No such job")
    tab.screenshot("not-found")
    with platform.client(user) as rz:
        job_id = rz.create_job(SLEEPER.format(name="csrf")).job_id
        try:
            # The session cookie alone (what a forged cross-site request would carry) is
            # not enough to change a job.
            refused = page.request.post(f"{platform.url}/ui/jobs/{job_id}/delete")
            assert refused.status == 403
            assert "CSRF" in refused.json()["message"]
            assert rz.get_job(job_id).status != job_pb2.DELETED
        finally:
            rz.delete_job(job_id)
    tab.assert_no_console_errors(lambda e: "404" in e)


def test_the_jobs_page_is_keyboard_navigable_and_fits_a_narrow_window(
    tab: Tab, platform: Platform
) -> None:
    with _users_job(platform, SLEEPER.format(name="narrow")) as (user, _rz, job_id):
        sign_in(tab, platform, platform.token(user))
        page = tab.page
        expect(page.locator(f"tr[data-job='{job_id}']")).to_be_visible()
        assert page_overflow(page) <= 0, "the jobs page is wider than a 1280x800 window"
        # Tab from the top reaches the job's link; Enter opens it.
        for _ in range(20):
            page.keyboard.press("Tab")
            if page.evaluate("document.activeElement.textContent") == job_id:
                break
        page.keyboard.press("Enter")
        page.wait_for_url(f"**/jobs/{job_id}")
        page.set_viewport_size({"width": 390, "height": 800})
        expect(page.locator("#status")).to_have_text("PROCESSING", timeout=60_000)
        tab.screenshot("narrow-job")
        assert page_overflow(page) <= 0, "the job page is wider than a 390px window"
        page.go_back()
        tab.screenshot("narrow")
        assert page_overflow(page) <= 0, "the jobs page is wider than a 390px window"
        page.goto(platform.url + "/cluster")  # nodes, quotas and queue tables
        expect(page.locator("h1")).to_have_text("Cluster")
        tab.screenshot("narrow-cluster")
        assert page_overflow(page) <= 0, "the cluster page is wider than a 390px window"
        tab.assert_no_console_errors()


def test_submit_the_mnist_example_and_watch_it_complete_with_logs_and_a_plotted_metric(
    tab: Tab, platform: Platform
) -> None:
    user = user_name()
    sign_in(tab, platform, platform.token(user), "/submit")
    page = tab.page
    # A broken manifest is flagged beside the field before anything is submitted.
    page.fill("#manifest", "name: broken\nlearners: many\nframework: {command: 'true'}\n")
    expect(page.locator("#manifest-error")).to_contain_text("learners")
    tab.screenshot("manifest-error")
    page.select_option("#example", "mnist")
    expect(page.locator("#manifest-ok")).to_be_visible()
    expect(page.locator("#manifest")).to_have_value(re.compile("name: mnist-digits"))
    page.click("#submit")
    page.wait_for_url("**/jobs/job-*")
    job_id = page.url.rsplit("/", 1)[1]
    expect(page.locator("h1")).to_contain_text("mnist-digits")
    expect(page.locator("#status")).to_have_text("COMPLETED", timeout=240_000)
    logs = page.locator("#logs")
    expect(logs).to_contain_text("epoch 10/10")
    expect(page.locator("#log-state")).to_contain_text("The job has ended")
    loss = page.locator("figure.plot[data-metric='loss']")
    expect(loss).to_have_attribute("data-points", "10")
    expect(loss.locator("canvas")).to_be_visible()
    expect(page.locator("figure.plot[data-metric='test_accuracy']")).to_be_visible()
    tab.screenshot("mnist-completed")
    # The log search (full text) finds the one line with the final accuracy.
    page.fill("#log-search", "final")
    page.click("#log-controls button[type=submit]")
    expect(page.locator("#log-state")).to_contain_text("1 matching line")
    expect(logs).to_contain_text("final test accuracy")
    with platform.client(user) as rz:
        assert rz.get_job(job_id).status == job_pb2.COMPLETED
    tab.assert_no_console_errors()


def test_a_one_time_login_link_signs_in_once(tab: Tab, platform: Platform) -> None:
    from services.dashboard.login_link import login_link

    admin = user_name()
    token_file = tab.shots / "admin.token"
    token_file.write_text(platform.token(admin, "admin"))
    link = login_link(platform.url, token_file)
    page = tab.page
    page.goto(link)
    page.click("text=Continue to the dashboard")
    expect(page.locator("h1")).to_have_text("All jobs")
    expect(page.locator(".who")).to_contain_text(f"{admin} (admin)")
    page.context.clear_cookies()
    page.goto(link)
    page.click("text=Continue to the dashboard")
    expect(page.locator("#login-message")).to_contain_text("already used or has expired")
    tab.screenshot("link-used")
    # A user token cannot make links.
    user_file = tab.shots / "user.token"
    user_file.write_text(platform.token(user_name()))
    with pytest.raises(Exception, match="403"):
        login_link(platform.url, user_file)
    tab.assert_no_console_errors(lambda e: "401" in e)


def test_the_jobs_page_filters_pages_and_updates_a_row_without_a_reload(
    tab: Tab, platform: Platform
) -> None:
    from services.manifest import parse_manifest
    from services.store.jobs import JobRecord, JobsRepository, StatusEntry, new_job_id
    from services.store.mongo import connect

    user = user_name()
    # 55 finished jobs, stored as records of the API's shape. Finished, so the scheduler
    # has nothing to do with them: inserted whole, because the repository's create()
    # stores a new job as QUEUED.
    repo = JobsRepository(connect(platform.daemon.config.mongodb_uri))
    manifest = parse_manifest(SLEEPER.format(name="stored"))
    docs = []
    for i in range(55):
        record = JobRecord.for_manifest(new_job_id(), user, manifest)
        record.name = f"{'alpha' if i % 5 == 0 else 'beta'}-{i:02d}"
        record.status = "COMPLETED" if i % 2 else "FAILED"
        record.created_at = record.updated_at = time.time()
        record.history = [StatusEntry("QUEUED", record.created_at, "submitted")]
        docs.append(record.to_doc())
    repo._col.insert_many(docs)
    sign_in(tab, platform, platform.token(user))
    page = tab.page
    rows = page.locator("#jobs tbody tr")
    expect(rows).to_have_count(50)
    expect(rows.first).to_contain_text("beta-54")  # newest first
    expect(page.locator("#total")).to_have_text("55 jobs")  # the count, not just the page
    page.click("#next-page")
    expect(rows).to_have_count(5)
    expect(rows.last).to_contain_text("alpha-00")
    page.goto(platform.url + "/")
    page.fill("#f-name", "alpha")
    page.select_option("#f-status", "FAILED")
    page.click("form.filters button[type=submit]")
    expect(rows).to_have_count(6)  # alpha-00, -10, ..., -50: the even ones failed
    expect(page.locator("#total")).to_have_text("6 jobs match this filter")
    for text in rows.all_inner_texts():
        assert "alpha-" in text and "FAILED" in text
    tab.screenshot("filtered")
    # A job submitted now shows up on the open page and moves on without a reload.
    page.goto(platform.url + "/")
    with platform.client(user) as rz:
        job_id = rz.create_job(SLEEPER.format(name="live")).job_id
        try:
            row = page.locator(f"tr[data-job='{job_id}']")
            expect(row).to_contain_text("PROCESSING", timeout=60_000)
            expect(row).to_contain_text("running")
        finally:
            rz.delete_job(job_id)
    expect(page.locator(f"tr[data-job='{job_id}']")).to_contain_text("DELETED", timeout=60_000)
    tab.assert_no_console_errors()


def test_the_spot_estimate_page_charts_every_strategy_and_names_a_missing_field(
    tab: Tab, platform: Platform
) -> None:
    sign_in(tab, platform, platform.token(user_name()), "/estimate")
    page = tab.page
    page.select_option("#est-trace", "aws-p3-64.csv")
    page.fill("#est-runs", "2")
    page.click("#est-run")
    chart = page.locator("#est-chart tbody tr")
    expect(chart.first).to_be_visible(timeout=60_000)
    strategies = chart.evaluate_all("rows => rows.map(r => r.dataset.strategy)")
    assert {"on-demand", "adaptive", "redundant"} <= set(strategies)
    assert any(s.startswith("checkpoint-restart/") for s in strategies)
    on_demand = page.locator("#est-chart tr[data-strategy='on-demand']")
    expect(on_demand).to_contain_text("100 %")
    expect(page.locator("#est-title")).to_contain_text("gpt2-small on 4 nodes")
    tab.screenshot("estimate")
    # Without the estimate: section the simulator's inputs are missing, and the page says which.
    page.fill(
        "#est-manifest",
        "name: no-estimate\ninstance_type: p3.2xlarge\nframework: {command: python t.py}\n",
    )
    page.click("#est-run")
    expect(page.locator("#est-error")).to_contain_text("estimate.steps")
    tab.assert_no_console_errors(lambda e: "400" in e)


TICKER = (
    'name: {name}\nmemory: 128MiB\nframework:\n  command: python -u -c "import time; '
    "[print('tick', i) or time.sleep(0.5) for i in range(600)]\"\n"
)
ELASTIC_SLEEPER = (
    "name: {name}\nmemory: 128MiB\nelastic: {{min: 1, max: 3}}\n"
    "framework:\n  command: python -c 'import time; time.sleep(600)'\n"
)


def test_a_dropped_log_stream_and_status_poll_reconnect_by_themselves_and_say_so(
    tab: Tab, platform: Platform
) -> None:
    with _users_job(platform, TICKER.format(name="ticker")) as (user, _rz, job_id):
        sign_in(tab, platform, platform.token(user))
        page = tab.page
        # The network between the page and the server drops: every live request of
        # this job's page fails at the network level, as on a lost connection.
        dropped = {"on": True}

        def drop(route: Any) -> None:
            if dropped["on"]:
                route.abort("connectionreset")
            else:
                route.continue_()

        page.route(re.compile(rf".*/ui/jobs/{job_id}(/logs.*)?$"), drop)
        page.goto(f"{platform.url}/jobs/{job_id}")
        expect(page.locator("#log-state")).to_contain_text("dropped; reconnecting")
        expect(page.locator("#outcome")).to_contain_text("Lost contact with the server")
        tab.screenshot("dropped")
        dropped["on"] = False
        # Nobody reloads: the page reconnects by itself and says so.
        expect(page.locator("#outcome")).to_have_text("Reconnected.", timeout=30_000)
        expect(page.locator("#log-state")).to_contain_text("Reconnected", timeout=60_000)
        expect(page.locator("#logs")).to_contain_text("tick", timeout=60_000)
        # The placement table names each learner's zone (deploy/cluster-local.yaml).
        expect(page.locator("#placement tbody")).to_contain_text("local-", timeout=60_000)
        tab.screenshot("reconnected")
        tab.assert_no_console_errors(lambda e: "ERR_CONNECTION_RESET" in e)


def test_an_elastic_job_is_scaled_from_its_page_and_a_refused_scale_says_why(
    tab: Tab, platform: Platform
) -> None:
    user = user_name()
    with platform.client(user) as rz:
        job_id = rz.create_job(ELASTIC_SLEEPER.format(name="stretchy")).job_id
        plain = rz.create_job(SLEEPER.format(name="not-elastic")).job_id
        try:
            # Halted: scaling changes the record (the learners it resumes with); the
            # running-job path is the LCM's, tested with `rhizome scale` (docs/elastic.md).
            wait_until(lambda: rz.get_job(job_id).status != job_pb2.QUEUED, "placement")
            rz.halt_job(job_id)
            sign_in(tab, platform, platform.token(user), f"/jobs/{job_id}")
            page = tab.page
            expect(page.locator("#status")).to_have_text("HALTED", timeout=60_000)
            page.fill("#scale-learners", "3")
            page.click("#btn-scale")
            expect(page.locator("#confirm-text")).to_contain_text("3 learner(s)")
            page.click("#confirm-ok")
            expect(page.locator("#outcome")).to_contain_text("scale done")
            assert rz.get_job(job_id).resources.learners == 3
            page.fill("#scale-learners", "9")
            page.click("#btn-scale")
            page.click("#confirm-ok")
            expect(page.locator("#outcome")).to_contain_text("outside the job's elastic bounds")
            tab.screenshot("scaled")
            # A job without `elastic:` has no Scale button at all.
            page.goto(f"{platform.url}/jobs/{plain}")
            expect(page.locator("#btn-halt")).to_be_visible()
            expect(page.locator("#btn-scale")).to_have_count(0)
            tab.assert_no_console_errors(lambda e: "400" in e)
        finally:
            rz.delete_job(job_id)
            rz.delete_job(plain)
