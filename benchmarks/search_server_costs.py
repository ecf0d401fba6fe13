"""What the embedded search server (noida-db) costs per request as one job's index grows:
a bulk of 5,000 log lines at each size, then at the full size a refresh, the high-water
aggregation (what `log_ingest.py` polls), and a store check of 20,000 lines done both
ways: main's (a refresh and a count query) and the branch's (the ids looked up).

    .venv/bin/python benchmarks/search_server_costs.py [--lines 160000]

Each figure is the request's wall time from one client and the server process's CPU
time over it (utime + stime from /proc/PID/stat: the server serves each connection on
a thread of its own, so the main thread's schedstat would miss it); `snapshot` is the
size of the file the server saves its data to while writes come. Issue #18, session 17.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from log_ingest import bench_line  # noqa: E402
from rhizome.v1 import tds_pb2  # noqa: E402

from services.embedded.servers import ElasticsearchServer  # noqa: E402
from services.tds.api import Query  # noqa: E402
from services.tds.es_store import ElasticsearchStore  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
BULK = 5000


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def server_pid(pid: int) -> int:
    """noida-db's console script runs the binary as its child."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids = (task / "children").read_text().split()
        if kids:
            return int(kids[0])
    return pid


def lines(job: str, start: int, n: int) -> list[tds_pb2.LogLine]:
    now_us = time.time_ns() // 1000
    return [bench_line(job, seq, now_us) for seq in range(start, start + n)]


def main_count(store: ElasticsearchStore, job: str, n: int) -> int:
    """main's count_stored (before session 17): a refresh, then a count query."""
    index = store.logs_index(job)
    query = {
        "bool": {
            "filter": [
                {"term": {"job_id": job}},
                {"term": {"learner": 0}},
                {"term": {"stream": "stdout"}},
                {"range": {"seq": {"gte": 0, "lt": n}}},
            ]
        }
    }
    store.es.indices.refresh(index=index, ignore_unavailable=True)
    return int(store.es.count(index=index, query=query, ignore_unavailable=True)["count"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=160_000, help="the index's final size")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rhizome-bench-") as tmp:
        es = ElasticsearchServer(Path(tmp) / "es")
        es.start()
        pid = server_pid(es.pid or 0)
        snapshot = Path(tmp) / "es" / "noida-data" / "elasticsearch.json"
        store = ElasticsearchStore(es.url, request_timeout_s=300)
        store.ensure_schema()
        job = f"costs-{uuid.uuid4().hex[:6]}"

        def timed(fn: Callable[..., Any], *a: Any) -> tuple[float, float, Any]:
            c0, t0 = cpu_s(pid), time.perf_counter()
            result = fn(*a)
            return time.perf_counter() - t0, cpu_s(pid) - c0, result

        print(f"load {os.getloadavg()}; one client, bulks of {BULK:,} lines into one index")
        print("| lines in the index | bulk ms | server CPU ms | snapshot MB |")
        print("| ---: | ---: | ---: | ---: |")
        try:
            for start in range(0, args.lines, BULK):
                wall, cpu, _ = timed(store.write_logs, lines(job, start, BULK))
                size = snapshot.stat().st_size / 1e6 if snapshot.exists() else 0.0
                print(f"| {start + BULK:,} | {wall * 1000:.0f} | {cpu * 1000:.0f} | {size:.1f} |")
            checked = min(20_000, args.lines)
            print(f"\nat {args.lines:,} lines:")
            print("| request | ms | server CPU ms | result |")
            print("| --- | ---: | ---: | ---: |")
            for name, fn, fargs in (
                ("refresh", store.refresh, (job,)),
                ("refresh, nothing new", store.refresh, (job,)),
                ("log_high_water (refresh + aggregation)", store.log_high_water, (Query(job),)),
                ("log_high_water again", store.log_high_water, (Query(job),)),
                (
                    f"main's check of {checked:,} lines (refresh + count)",
                    main_count,
                    (store, job, checked),
                ),
                ("the same again", main_count, (store, job, checked)),
                (
                    f"the branch's check of {checked:,} lines (ids looked up)",
                    store.count_stored,
                    ("log", job, 0, "stdout", 0, checked),
                ),
            ):
                wall, cpu, res = timed(fn, *fargs)
                shown = res if isinstance(res, int) else ""
                print(f"| {name} | {wall * 1000:.0f} | {cpu * 1000:.0f} | {shown} |")
        finally:
            store.close()
            es.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
