"""What the platform now records of a running job, seen through every door: its last
metric (the jobs list), the checkpoints it took, its spot cost so far and the estimate
to finish (the job page), each also in `rhizome show --json`, REST and gRPC. Against the
browser tests' daemon (every service over real etcd, MongoDB-wire and Elasticsearch-API
servers) and a real headless Chromium."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import urllib.request
import zipfile
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import Platform, Tab, sign_in, user_name, wait_until

pytestmark = pytest.mark.integration

# Three steps, each printing its loss and backing up a checkpoint of 2 kB × step through
# the checkpoint SDK, then it keeps running (a running job has a cost and an estimate).
TRAIN = """\
import time
import learner.sdk as rz

for i in range(1, 4):
    with rz.step():
        time.sleep(0.1)
    print(f"step {i} loss={1.0 / i:.4f}", flush=True)
    path = rz.staging_path(f"model-{i}.bin")
    path.write_bytes(b"x" * 2048 * i)
    rz.backup(path, step=i)
rz.wait_backups()
time.sleep(600)
"""
MANIFEST = """\
name: {name}
memory: 256MiB
framework:
  command: python -u train.py
evaluation_metrics:
  type: regex_extractor
  in: stdout
  regex: 'step (?P<step>\\d+) loss=(?P<loss>[0-9.]+)'
  step: step
estimate:
  steps: 10
  step_time: 5s
  save_time: 1s
  prices: {{on_demand: 3.06, spot: 0.918}}
"""


def code_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("train.py", TRAIN)
    return buf.getvalue()


def rest_job(platform: Platform, user: str, job_id: str) -> dict[str, Any]:
    req = urllib.request.Request(
        f"{platform.url}/v1/models/{job_id}",
        headers={"Authorization": f"Bearer {platform.token(user)}"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return dict(json.loads(resp.read()))


def cli_show(platform: Platform, user: str, job_id: str, *extra: str) -> str:
    env = {**os.environ, "RHIZOME_TOKEN": platform.token(user), "COLUMNS": "200"}
    api = platform.daemon.config.grpc_address
    proc = subprocess.run(
        [sys.executable, "-m", "services.client.cli", "--api", api, "show", job_id, *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, f"rhizome show exited {proc.returncode}: {proc.stderr}"
    return proc.stdout


def test_a_jobs_last_metric_checkpoints_and_cost_show_on_the_pages_cli_rest_and_grpc(
    tab: Tab, platform: Platform
) -> None:
    user = user_name()
    with platform.client(user) as rz:
        job_id = rz.create_job(MANIFEST.format(name="recorded"), code_zip()).job_id
        try:
            # The TDS writes the last values and the checkpoints onto the record (gRPC).
            def recorded() -> bool:
                job = rz.get_job(job_id)
                return len(job.checkpoints) == 3 and any(
                    m.name == "loss" and m.step == 3 for m in job.last_metrics
                )

            wait_until(recorded, "3 checkpoints and the loss of step 3 on the record", 120)
            job = rz.get_job(job_id)
            loss = next(m for m in job.last_metrics if m.name == "loss")
            assert loss.value == pytest.approx(1 / 3, abs=1e-3)
            assert [(c.kind, c.step, c.size_bytes) for c in job.checkpoints] == [
                ("periodic", 1, 2048),
                ("periodic", 2, 4096),
                ("periodic", 3, 6144),
            ]
            assert all(c.time.seconds > 0 for c in job.checkpoints)

            # REST: the same fields in the public job document.
            body = rest_job(platform, user, job_id)
            assert [c["size_bytes"] for c in body["checkpoints"]] == ["2048", "4096", "6144"]
            assert any(m["name"] == "loss" for m in body["last_metrics"])

            # rhizome show --json: the record's fields, the cost so far and the estimate.
            shown = json.loads(cli_show(platform, user, job_id, "--json"))
            assert [c["kind"] for c in shown["checkpoints"]] == ["periodic"] * 3
            assert shown["cost_so_far"]["dollars"] > 0  # deploy/cluster-local.yaml prices
            assert shown["cost_so_far"]["unpriced"] == []
            left = shown["estimate_to_finish"]
            assert not left["problem"], left["problem"]
            assert (left["steps_done"], left["steps_total"]) == (3, 10)
            assert left["dollars"] > 0
            text = cli_show(platform, user, job_id)
            assert "last metrics: loss=0.3333 (step 3)" in text
            assert "cost so far: $" in text and "to finish: $" in text
            assert "checkpoints" in text and "6.1 kB" in text

            # The pages: the jobs list's row, then the job page.
            sign_in(tab, platform, platform.token(user))
            page = tab.page
            row = page.locator(f"tr[data-job='{job_id}']")
            expect(row.locator("td.metric")).to_have_text("loss 0.3333 (step 3)")
            tab.screenshot("jobs-last-metric")
            page.goto(f"{platform.url}/jobs/{job_id}")
            saves = page.locator("#checkpoints tbody tr[data-kind='periodic']")
            expect(saves).to_have_count(3)
            expect(saves.first).to_contain_text("6.1 kB")  # newest first
            expect(page.locator("#cost-so-far")).to_contain_text("$")
            expect(page.locator("#cost-so-far")).to_contain_text("node-hours")
            expect(page.locator("#cost-to-finish")).to_contain_text("steps 3–10")
            tab.screenshot("job-checkpoints-cost")
            tab.assert_no_console_errors()
        finally:
            rz.delete_job(job_id)
