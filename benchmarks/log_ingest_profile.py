"""Where the time goes when learners burst into the search server: `log_ingest.py`'s
`run_case` with every process's CPU sampled, every bulk request of the TDS timed, and
every search-server request counted by kind.

    .venv/bin/python benchmarks/log_ingest_profile.py [--learners 8] [--lines 20000]
        [--poll-s 2] [--repo PATH] [--spy FILE]

- CPU: utime + stime of each process (/proc/PID/stat, threads that exited included) from
  start to end, summed by kind: search server, TDS, collectors, printers, this process
  (whose share is the benchmark's poll).
- Bulks: the TDS runs with its store's bulk request timed (this script, `--serve-tds`):
  when, how long, how many documents (more than the lines printed: some written twice),
  which learner, and whether it failed.
- Requests: every request the TDS and the poller sent to the search server
  (elastic_transport's log), with its total time as the client saw it.
- `--repo PATH` runs another checkout's TDS, collectors and `run_case` (e.g. a worktree
  of main, for the comparison measured in the same session); `--spy FILE` records the
  TDS with py-spy (`$PY_SPY`, default `py-spy`) into FILE (raw, folded stacks).
Issue #18, session 17.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")
REQUEST = re.compile(
    r"\b(GET|POST|PUT|HEAD|DELETE) http://[^/]+/(\S*) \[status:\d+ duration:([\d.]+)s\]"
)


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--learners", type=int, default=8)
    ap.add_argument("--lines", type=int, default=20000, help="lines per learner")
    ap.add_argument("--poll-s", type=float, default=2.0, help="the poller's pause")
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--spy", type=Path, help="record the TDS with py-spy into this file")
    ap.add_argument("--serve-tds", metavar="TIMING_LOG", help=argparse.SUPPRESS)
    return ap.parse_known_args(argv)[0]


def serve_tds(repo: Path, timing_log: str, tds_args: list[str]) -> int:
    """`python -m services.tds` of `repo`, each bulk request written to `timing_log` as
    `start_s seconds documents learner outcome`."""
    sys.path.insert(0, str(repo))
    from services.tds import es_store
    from services.tds.server import main

    out = open(timing_log, "a", buffering=1)  # noqa: SIM115 - open for the process's life
    bulk = es_store.ElasticsearchStore._bulk

    def timed(self: Any, body: str, count: int) -> int:
        t0, outcome = time.time(), "ok"
        try:
            return bulk(self, body, count)
        except Exception as exc:
            outcome = type(exc).__name__
            raise
        finally:
            at = body.find('"learner":')
            learner = body[at + 10 : body.find(",", at)] if at >= 0 else "?"
            out.write(f"{t0:.3f} {time.time() - t0:.3f} {count} {learner} {outcome}\n")

    es_store.ElasticsearchStore._bulk = timed  # type: ignore[method-assign]
    return main(tds_args)


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for kid in kids:
            out += [kid, *descendants(kid)]
    return out


def kind_of(pid: int) -> str:
    if pid == os.getpid():
        return "this (poll)"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?"
    for needle, kind in (
        ("noida", "search server"),
        ("--serve-tds", "tds"),
        ("collector", "collector"),
        ("import sys, time", "printer"),
        ("py-spy", "py-spy"),
    ):
        if needle in cmd:
            return kind
    return "other"


class CpuSampler(threading.Thread):
    """Every 0.2 s, the CPU time of this process and all its descendants; a process's
    share is its last sample less its first (one that lived < 0.2 s is missed)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.done = threading.Event()
        self.seen: dict[int, tuple[str, float, float]] = {}

    def sample(self) -> None:
        for pid in [os.getpid(), *descendants(os.getpid())]:
            try:
                now = cpu_s(pid)
            except OSError:
                continue
            kind, first, _ = self.seen.get(pid) or (kind_of(pid), now, now)
            self.seen[pid] = (kind, first, now)

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.sample()

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = collections.defaultdict(float)
        for kind, first, last in self.seen.values():
            out[kind] += last - first
        return out


def requests_by_kind(log: Path) -> dict[str, list[float]]:
    kinds: dict[str, list[float]] = collections.defaultdict(list)
    for line in log.read_text().splitlines():
        m = REQUEST.search(line)
        if m:
            path = m.group(2).split("?")[0]
            what = next(
                (k for k in ("_bulk", "_mget", "_refresh", "_count", "_search") if k in path),
                "other",
            )
            kinds[f"{m.group(1)} {what}"].append(float(m.group(3)))
    return kinds


def main() -> int:
    args = parse(sys.argv[1:])
    repo = args.repo.resolve()
    if args.serve_tds:
        rest = sys.argv[sys.argv.index("--") + 1 :]
        return serve_tds(repo, args.serve_tds, rest)
    sys.path.insert(0, str(repo))
    sys.path.insert(0, str(repo / "benchmarks"))
    import log_ingest

    from contract.procs import free_port, stop_process_group
    from services.embedded.servers import ElasticsearchServer
    from services.tds.es_store import ElasticsearchStore

    with tempfile.TemporaryDirectory(prefix="rhizome-bench-") as tmp:
        work = Path(tmp)
        poll_log = work / "poll-requests.log"
        handler = logging.FileHandler(poll_log)
        logging.getLogger("elastic_transport").addHandler(handler)
        logging.getLogger("elastic_transport").setLevel(logging.INFO)
        es = ElasticsearchServer(work / "es")
        es.start()
        timing, tds_log, port = work / "bulks.log", work / "tds.log", free_port()
        timing.touch()
        sampler, store = CpuSampler(), ElasticsearchStore(es.url)
        tds: subprocess.Popen[bytes] | None = None
        spy: subprocess.Popen[bytes] | None = None
        t0 = time.monotonic()
        try:
            with open(tds_log, "ab") as out:
                tds = subprocess.Popen(
                    [sys.executable, __file__, "--repo", str(repo), "--serve-tds", str(timing),
                     "--", "--address", f"127.0.0.1:{port}", "--es-url", es.url],
                    cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            while b"tds listening on" not in tds_log.read_bytes():
                if tds.poll() is not None:
                    raise RuntimeError(f"TDS did not start: {tds_log.read_text()[-2000:]}")
                time.sleep(0.05)
            sampler.sample()
            sampler.start()
            if args.spy is not None:
                spy = subprocess.Popen(
                    [os.environ.get("PY_SPY", "py-spy"), "record", "-p", str(tds.pid), "-r",
                     "50", "-f", "raw", "-o", str(args.spy), "--nonblocking"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                )  # fmt: skip
            t0 = time.monotonic()
            r = log_ingest.run_case(
                store, f"127.0.0.1:{port}", work, args.learners, args.lines, 0, poll_s=args.poll_s
            )
        finally:
            wall = time.monotonic() - t0
            if sampler.is_alive():
                sampler.sample()
                sampler.done.set()
                sampler.join()
            if spy is not None:
                spy.send_signal(2)
                spy.wait(30)
            store.close()
            if tds is not None:
                stop_process_group(tds.pid)
            es.stop()
        print(f"repo {repo}; load {os.getloadavg()}")
        print(
            f"{args.learners} x {args.lines:,} lines, polled every {args.poll_s:g} s: "
            f"{r['lines_per_s']:,.0f} lines/s, fairness {r['fairness']:.2f}, "
            f"p50 {r['p50']:.2f} s, p99 {r['p99']:.2f} s"
        )
        cpu = sampler.totals()
        print(f"\nCPU over {wall:.1f} s (the case, then its collectors' drain):")
        for kind in sorted(cpu, key=lambda k: -cpu[k]):
            print(f"  {kind:14} {cpu[kind]:6.1f} s  {cpu[kind] / wall:4.0%} of one core")
        rows = [ln.split() for ln in timing.read_text().splitlines()]
        docs = sum(int(row[2]) for row in rows)
        total = args.learners * args.lines
        first = min((float(row[0]) for row in rows), default=0.0)
        last = max((float(row[0]) + float(row[1]) for row in rows), default=0.0)
        failed = sum(row[4] != "ok" for row in rows)
        print(
            f"\nbulks: {len(rows)}, {docs:,} documents for {total:,} lines "
            f"({docs - total:,} written twice), {failed} failed; "
            f"stored {total / max(last - first, 1e-6):,.0f} lines/s from the first bulk's "
            f"start to the last one's end; longest {max(float(row[1]) for row in rows):.1f} s"
        )
        ends: dict[str, float] = {}
        for row in rows:
            ends[row[3]] = max(ends.get(row[3], 0.0), float(row[0]) + float(row[1]) - first)
        print("each learner's last bulk done at: "
              + ", ".join(f"{k} {v:.1f} s" for k, v in sorted(ends.items())))  # fmt: skip
        print("\nsearch-server requests, total time as their client saw it:")
        for who, log in (("tds", tds_log), ("poll", poll_log)):
            for what, times in sorted(requests_by_kind(log).items(), key=lambda kv: -sum(kv[1])):
                print(
                    f"  {who:4} {what:14} {len(times):4}  {sum(times):7.2f} s  max {max(times):.2f} s"
                )
        if spy is not None:
            print(f"\npy-spy of the TDS: {args.spy}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
