"""The web dashboard with 10,000 jobs stored: time to serve the jobs page and a job page,
and the time from a line printed by a learner to that line showing in an open job page.

    .venv/bin/python benchmarks/dashboard.py [--jobs 10000] [--requests 60] [--lines 60]

Everything is real and local: etcd, the MongoDB-wire server (SecantusDB), the
Elasticsearch-API server (noida-db) and `rhizomed` hosting every service as its own
process, Debian's chromium (through playwright) as the browser.

Page times are measured by an HTTP client on the same machine (loopback), so they are an
upper bound on the server's time. The baseline measured in the same run is the JSON API
serving the same data: `GET /v1/models?page_size=50` for the jobs page (the same indexed
query) and `GET /v1/models/{id}` for the job page; the ratio says what rendering HTML costs.

Print -> visible: a learner prints a line with its wall-clock time every 0.25 s; the open
job page records (MutationObserver, Date.now()) when each line appears in the log view.
The baseline in the same run is a plain API follower (`GET .../logs?follow=true`, what
`rhizome logs --follow` reads) stamping each line's arrival: the pipeline's own lag (the
collector's flush, the TDS, the search server's refresh), which the page cannot beat.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "gen")]

import httpx  # noqa: E402

from contract.procs import free_port  # noqa: E402
from services.embedded.platform import DaemonServer  # noqa: E402
from services.embedded.servers import ElasticsearchServer, EtcdServer, MongoServer  # noqa: E402
from services.manifest import parse_manifest  # noqa: E402
from services.store import states  # noqa: E402
from services.store.jobs import JobRecord, JobsRepository, StatusEntry, new_job_id  # noqa: E402
from services.store.mongo import connect  # noqa: E402

PAGE_GOAL_MS = 300.0
LAG_GOAL_S = 2.0
PRINTER = """import sys, time
time.sleep(3)  # the page is open before the first line
for i in range({lines}):
    print(f"tick {{i}} {{time.time():.6f}}", flush=True)
    time.sleep(0.25)
"""
MANIFEST = "name: printer\nmemory: 128MiB\nframework:\n  command: python printer.py\n"
# Records when each log line appears in the page (the page's own clock is the machine's).
OBSERVE = """() => {
  window.__seen = [];
  const logs = document.getElementById('logs');
  new MutationObserver((changes) => {
    const now = Date.now() / 1000;
    for (const c of changes) for (const n of c.addedNodes) window.__seen.push([n.textContent, now]);
  }).observe(logs, {childList: true});
}"""


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


def store_jobs(mongo_url: str, count: int) -> str:
    """`count` finished jobs of user `bench`, inserted in bulk; returns one job's id."""
    repo = JobsRepository(connect(mongo_url))
    repo.ensure_indexes()
    manifest = parse_manifest(MANIFEST)
    now = time.time()
    batch: list[dict[str, Any]] = []
    some_id = ""
    for i in range(count):
        record = JobRecord.for_manifest(new_job_id(), "bench", manifest)
        record.name = f"bench-{i:05d}"
        record.status = states.COMPLETED
        record.created_at = record.updated_at = now - (count - i)
        record.history = [
            StatusEntry(s, now - (count - i) + k, m)
            for k, (s, m) in enumerate(
                [
                    (states.QUEUED, "submitted"),
                    (states.PENDING, "placed on local-cpu-0"),
                    (states.DEPLOYING, "deploying"),
                    (states.PROCESSING, "learners are PROCESSING"),
                    (states.COMPLETED, "every learner finished"),
                ]
            )
        ]
        record.placement = {"learner_nodes": {"0": "local-cpu-0"}, "placed_at": now}
        # What a job that trained carries since the page shows it: its last metrics (the
        # TDS's, services/tds/last_metrics.py) and its checkpoints (contract/checkpoints.py).
        at = now - (count - i) + 3
        record.last_metrics = [
            {"name": n, "value": 0.5, "step": 900, "time": at, "learner": 0}
            for n in ("loss", "accuracy", "throughput")
        ]
        record.checkpoints = [
            {
                "kind": "periodic",
                "step": 100 * k,
                "size_bytes": 10**8,
                "time": at,
                "learner": "0",
                "name": f"ckpt-{k}-periodic-s{100 * k}",
            }
            for k in range(10)
        ]
        batch.append(record.to_doc())
        some_id = record.job_id
        if len(batch) == 1000:
            repo._col.insert_many(batch)  # a benchmark's bulk load, not a code path
            batch = []
    if batch:
        repo._col.insert_many(batch)
    return some_id


def sign_in(http: httpx.Client, token: str) -> None:
    page = http.get("/login").text
    csrf = re.search(r'name="csrf" value="([^"]+)"', page)
    assert csrf, "no CSRF field on the login page"
    resp = http.post("/login", data={"token": token, "csrf": csrf.group(1), "next": "/"})
    assert resp.status_code == 303, f"sign-in failed: {resp.status_code}"


def timed(
    http: httpx.Client, path: str, n: int, headers: dict[str, str] | None = None
) -> list[float]:
    http.get(path, headers=headers)  # warm
    out = []
    for _ in range(n):
        start = time.perf_counter()
        resp = http.get(path, headers=headers)
        out.append((time.perf_counter() - start) * 1000)
        assert resp.status_code == 200, f"{path}: {resp.status_code}"
    return out


def second_page_token(http: httpx.Client, bearer: dict[str, str]) -> str:
    resp = http.get("/v1/models?page_size=50", headers=bearer)
    token = resp.json().get("next_page_token", "")
    assert token, f"no second page: {resp.text[:200]}"
    return str(token)


def timed_call(fn: Any, n: int) -> list[float]:
    fn()  # warm
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1000)
    return out


def row(label: str, ms: list[float], base: list[float] | None) -> str:
    ratio = f"{statistics.median(ms) / statistics.median(base):.2f}x" if base else "1.00x"
    return (
        f"{label:<48} {statistics.median(ms):8.1f} {pct(ms, 95):8.1f} {pct(ms, 99):8.1f}  {ratio}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--lines", type=int, default=60)
    parser.add_argument(
        "--no-latency", action="store_true", help="page times only, no print -> visible part"
    )
    args = parser.parse_args()
    # A SIGTERM (a `timeout` wrapper) still stops the servers this script started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    data = Path(tempfile.mkdtemp(prefix="rhizome-bench-dash-"))
    etcd = EtcdServer(data / "deps" / "etcd")
    mongo = MongoServer(data / "deps" / "mongo")
    es = ElasticsearchServer(data / "deps" / "es")
    port, rest = free_port(), free_port()
    daemon = DaemonServer(
        data,
        port,
        rest,
        [
            f"--mongodb-uri={mongo.url}",
            f"--etcd={etcd.url}",
            f"--elasticsearch-url={es.url}",
            f"--admin-token-file={data / 'admin.token'}",
        ],
    )
    daemon.start_timeout_s = 90
    started: list[Any] = []
    try:
        for server in (etcd, mongo, es):
            server.start()
            started.append(server)
        print(f"storing {args.jobs} jobs ...", file=sys.stderr)
        some_id = store_jobs(mongo.url, args.jobs)
        daemon.start()
        started.append(daemon)
        base_url = f"http://127.0.0.1:{rest}"
        token = (data / "admin.token").read_text().strip()
        bearer = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=base_url, timeout=30) as http:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if http.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            sign_in(http, token)
            n = args.requests
            api_list = timed(http, "/v1/models?page_size=50", n, bearer)
            page_list = timed(http, "/", n)
            page_filtered = timed(http, "/?status=COMPLETED&name=bench-099", n)
            page_rare = timed(http, "/?status=QUEUED", n)
            page_second = timed(http, "/?page=" + second_page_token(http, bearer), n)
            api_job = timed(http, f"/v1/models/{some_id}", n, bearer)
            page_job = timed(http, f"/jobs/{some_id}", n)
            api_json = timed(http, "/ui/jobs", n)
            # Where the list's time goes, called from this process: the query the
            # repository made before its JobIndex (the server sorts every record), and the
            # repository now (its index's refresh read + the page's records by id).
            repo = JobsRepository(connect(mongo.url))
            raw_query = timed_call(lambda: list(repo._col.find({}).sort("job_id", -1).limit(51)), n)
            repo_list = timed_call(lambda: repo.list_page(None, [], "", 50, ""), n)
            repo_count = timed_call(lambda: repo.count(None), n)
            print(f"\n{args.jobs} jobs stored; {n} requests each; times in ms (loopback client)")
            print(f"{'request':<48} {'p50':>8} {'p95':>8} {'p99':>8}  vs API")
            print(row("API GET /v1/models?page_size=50 (baseline)", api_list, None))
            print(row("jobs page / (first 50 of all, admin)", page_list, api_list))
            print(row("jobs page filtered (status + name prefix)", page_filtered, api_list))
            print(row("jobs page filtered (a status no job has)", page_rare, api_list))
            print(row("jobs page 2 (?page=token)", page_second, api_list))
            print(row("jobs page's live poll GET /ui/jobs", api_json, api_list))
            print(row("  old query: find().sort(job_id).limit(51)", raw_query, api_list))
            print(row("  JobsRepository.list_page(50) (JobIndex)", repo_list, raw_query))
            print(row("  JobsRepository.count() (the page's N jobs)", repo_count, raw_query))
            print(row("API GET /v1/models/{id} (baseline)", api_job, None))
            print(row("job page /jobs/{id}", page_job, api_job))
            print(
                "old query p50 / JobIndex list_page p50: "
                f"{statistics.median(raw_query) / statistics.median(repo_list):.1f}x"
            )
            met = pct(page_list, 99) < PAGE_GOAL_MS
            print(
                f"goal jobs page p99 < {PAGE_GOAL_MS:.0f} ms: {'met' if met else 'NOT met'}"
                f" ({pct(page_list, 99):.1f} ms)"
            )
            if args.no_latency:
                return
            lag_page, lag_api = print_to_visible(http, base_url, token, bearer, args.lines, data)
        print(f"\nprint -> visible, {args.lines} lines printed 0.25 s apart; seconds")
        print(f"{'path':<48} {'p50':>8} {'p99':>8} {'max':>8}")
        for label, lags in (
            ("API follow GET .../logs?follow=true (baseline)", lag_api),
            ("open job page (SSE -> DOM)", lag_page),
        ):
            print(f"{label:<48} {pct(lags, 50):8.2f} {pct(lags, 99):8.2f} {max(lags):8.2f}")
        print(
            f"page p99 / API p99: {pct(lag_page, 99) / pct(lag_api, 99):.2f}x; "
            f"goal page p99 < {LAG_GOAL_S:.0f} s: {'met' if pct(lag_page, 99) < LAG_GOAL_S else 'NOT met'}"
        )
    finally:
        for server in reversed(started):
            server.stop()
        shutil.rmtree(data, ignore_errors=True)


def print_to_visible(
    http: httpx.Client,
    base_url: str,
    token: str,
    bearer: dict[str, str],
    lines: int,
    data: Path,
) -> tuple[list[float], list[float]]:
    import io
    import zipfile

    from playwright.sync_api import sync_playwright

    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("printer.py", PRINTER.format(lines=lines))
    resp = http.post(
        "/v1/models",
        headers=bearer,
        files={
            "manifest": ("manifest.yml", MANIFEST),
            "model_definition": ("code.zip", archive.getvalue()),
        },
    )
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["job_id"]
    api_seen: list[tuple[str, float]] = []

    def follow() -> None:
        with httpx.stream(
            "GET",
            f"{base_url}/v1/models/{job_id}/logs?follow=true",
            headers=bearer,
            timeout=None,
        ) as stream:
            for line in stream.iter_lines():
                if line:
                    api_seen.append((json.loads(line).get("line", ""), time.time()))

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    session = http.cookies.get("rz_session")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path="/usr/bin/chromium",
            args=["--no-sandbox", "--disable-background-networking"],
        )
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        context.add_cookies([{"name": "rz_session", "value": session or "", "url": base_url}])
        page = context.new_page()
        page.goto(f"{base_url}/jobs/{job_id}")
        page.evaluate(OBSERVE)
        # Polled from here: the page's CSP (no eval) refuses wait_for_function's predicate.
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            status = page.evaluate("document.getElementById('status').textContent")
            ticks = page.evaluate("window.__seen.filter(s => s[0].includes('tick ')).length")
            if status == "COMPLETED" and ticks >= lines:
                break
            time.sleep(0.5)
        seen = page.evaluate("window.__seen")
        page.screenshot(path=str(data / "job-page.png"), full_page=True)
        browser.close()
    follower.join(timeout=30)

    def lags(found: list[Any]) -> list[float]:
        out = []
        for text, at in found:
            m = re.search(r"tick \d+ ([0-9.]+)", text)
            if m:
                out.append(float(at) - float(m.group(1)))
        return out

    return lags(seen), lags(api_seen)


if __name__ == "__main__":
    main()
