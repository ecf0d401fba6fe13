"""The control plane with N jobs alive at once: what each job costs and what breaks first.

For each N, a fresh platform (real etcd, MongoDB-wire server, `rhizomed` hosting api,
scheduler and lcm) runs with the simulated backend (services/backends/simulated): every
job goes through the real API, scheduler, LCM, guardian, etcd and MongoDB, but its
learners are threads that write their status keys and log lines and train nothing. The
script submits N one-learner jobs from 8 clients, waits until all N are PROCESSING at
once, holds them there for a steady window, then releases them all together and waits
for all N to be COMPLETED. It reports, per N:

- submit → PROCESSING p50/p99 (from each job's history) and the time for all N;
- the daemon's RSS and CPU; the guardians' count, RSS and CPU; per job, and the CPU per
  job per second of the steady window (the cost of merely keeping a job alive);
- etcd keys and MongoDB documents per job while all are alive;
- the MongoDB-wire server's CPU (its process's, /proc/<pid>/stat) per job while the N
  submits are made ("mongo submit ms/job"), from the last submit until all N are
  PROCESSING ("mongo start ms/job": the placements, set-ups and deploys, and what reads
  them), and per alive job per second of the steady window: what the platform's reads
  of new and changed records cost the store. The script's own reads are in it: it
  waits for each phase by one read of the pending jobs' statuses every
  `POLL_S` (2 s), not a read per job;
- etcd's own CPU and the lease keep-alives it received, per alive job per second of the
  steady window (its /metrics: `process_cpu_seconds_total`, the messages of its
  LeaseKeepAlive streams): what the learners' leases (`--learner-lease-ttl`), the hosts'
  and the daemon's cost the store;
- release → COMPLETED p50/p99 (status-change latency) and whether any job missed its
  COMPLETED (a lost status change);
- the etcd authentication storm: every job's etcd user added and removed by the LCM
  refuses every client's token once, and each client authenticates again. Counted two
  ways: etcd's own count of Authenticate, UserAdd and UserDelete calls (its /metrics)
  per job, and the re-authentications (`EtcdClient.reauthentications`) the guardian
  hosts (their own client and their simulated learners') and the LCM log, per job;
- what went wrong: FAILED jobs by reason, hosts that lost their lease or exited, backend
  calls that timed out, a daemon that lost its leadership or exited (its last log lines;
  `RHIZOME_BENCH_KEEP=1` keeps every log of the run);
- cost per job at the largest N against the smallest (goal: ≤ 1.2x), and the memory a
  10,000-job run would need at the measured cost per job against this machine's memory:
  what breaks first.

Each size runs in each mode (`--modes`): `process`, a guardian process per job, and
`hosts`, guardian hosts of `--per-host` jobs each (`RHIZOME_GUARDIANS_PER_HOST`,
docs/control-plane-scale.md); the hosts' figures are then compared with the processes'
at each N measured in the same run. "Guardian" figures are those of every guardian
process (hosts included). With the simulated backend a job's learner is threads in that
process (its lease's keep-alive: a thread, a grpc stream and its reader; the backend's
poller of SIM_UNTIL_FILE), whose CPU a real learner's own process pays: the steady
figures count them apart. The daemon and the guardians get a `sitecustomize` (written by
this script, first on their PYTHONPATH) that names every thread a simulated learner
started, and those it started in turn, `rz-sim-learner` in the OS; the CPU of those
threads (the scheduler's count, /proc/<pid>/task/<tid>/schedstat: `stat`'s per-thread
ticks miss most of a thread that runs in short bursts) is "sim learners", the rest of the
process's is the host's own ("steady guardian ms/job/s"). gRPC's own threads (shared by the host's
and the learners' channels) stay in the host's figure. The whole-run "guardian CPU
s/job" includes the learners.

With `--baseline-tree DIR` (a checkout of other code, e.g. `git archive main | tar -x -C
DIR`; its `gen/` stubs are this tree's) each size and mode also runs on that code first,
in the same run: the daemon and the guardian hosts import DIR's packages (PYTHONPATH),
and the steady CPU per alive job and the latencies of both are printed side by side.
With `--baseline-learner-lease-ttl S` the baseline runs' learners hold leases of S
seconds (the rest as the other runs'); without `--baseline-tree` the baseline is then this
tree: the learners' lease TTL against `--learner-lease-ttl`, same code, same run.
With `--repeat K` each size and mode runs K times, the two trees interleaved (baseline,
this tree, baseline, ...): each pair is compared, then the median over the pairs. The
load average (`uptime`'s 1-minute figure) at the steady window's start and end is
printed with each.
The steady window opens `--settle-s` (30) seconds after the last job reached PROCESSING,
not at it: the start's tail (the last jobs' guardians settling, re-authentications, the
look-backs over the start's writes) is not the steady state, and a window opened at the
last PROCESSING holds more of it the faster the start ends. Its two halves are printed
apart ("halves"): about equal when the window was flat. It should cover the slowest
periodic work (a hosted guardian's safety poll, the LCM's full round and the
scheduler's full release read, 30 s each): `--steady 30`.

    .venv/bin/python benchmarks/control_plane_scale.py [--sizes 10,25,50] [--steady 10]
        [--settle-s 30] [--modes process,hosts] [--per-host 500] [--phase-timeout S] [--baseline-tree DIR]
        [--repeat K] [--leader-lease-ttl S] [--learner-lease-ttl S] [--baseline-learner-lease-ttl S]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _load import percentile
from _platform import BenchPlatform

from contract.etcd import EtcdClient
from contract.etcd_keys import ROOT
from contract.learner_spec import DEFAULT_LEARNER_LEASE_TTL_S
from services.client.sdk import Client
from services.config import PlatformConfig
from services.lcm.hosting import GUARDIANS_PER_HOST_ENV
from services.store import states
from services.store.jobs import JobsRepository
from services.store.mongo import connect

CLIENTS = 8
ROOT_DIR = Path(__file__).resolve().parent.parent
CLUSTER = """nodes:
  - name: sim
    count: 4
    cpus: 100000
    memory_mb: 100000000
    zone: sim-a
"""


def manifest(n: int, until: Path, learner_ttl_s: int = DEFAULT_LEARNER_LEASE_TTL_S) -> str:
    return (
        f"name: scale-{n}\nlearners: 1\ncpus: 1\nmemory: 16MiB\n"
        "framework:\n  command: 'simulated'\n"
        f"env:\n  SIM_SECONDS: '1'\n  SIM_LOG_LINES: '5'\n  SIM_UNTIL_FILE: '{until}'\n"
        # The learners' lease TTL, given by the job: a baseline tree from before the
        # platform's setting (RHIZOME_LEARNER_LEASE_TTL_S; its learners' leases were 2 s)
        # runs its learners at the same TTL (services/backends/simulated).
        f"  SIM_LEASE_TTL_S: '{learner_ttl_s}'\n"
    )


def proc_stat(pid: int) -> tuple[float, float]:
    """(RSS in MiB, CPU seconds used so far) of a live process; (0, 0) once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20, cpu


# The OS name (comm, at most 15 bytes) of a simulated learner's threads in a guardian.
SIM_THREAD = "rz-sim-learner"
# Put first on the PYTHONPATH of the daemon and the guardians (both trees): every thread
# started by a simulated learner's thread (`sim-<job>-<rank>`, the backend's `sim-until`)
# or by one of those (its lease keep-alive, the keep-alive stream's reader, gRPC's
# request-iterator thread, the learners' channel's spin thread) is named SIM_THREAD in
# the OS, so its CPU can be told from the host's own. Nothing else changes.
SITECUSTOMIZE = f"""
import ctypes
import threading

_prctl = ctypes.CDLL(None, use_errno=True).prctl
_start = threading.Thread.start
_bootstrap_inner = threading.Thread._bootstrap_inner


def _is_sim(thread):
    return thread.name.startswith("sim-") or getattr(thread, "_rz_sim", False)


def start(self):
    self._rz_sim = _is_sim(threading.current_thread())
    _start(self)


def bootstrap_inner(self):
    if _is_sim(self):
        _prctl(15, b"{SIM_THREAD}", 0, 0, 0)  # PR_SET_NAME
    _bootstrap_inner(self)


threading.Thread.start = start
threading.Thread._bootstrap_inner = bootstrap_inner
"""


def thread_cpu(task_dir: Path) -> float:
    """CPU seconds so far of one thread (`/proc/<pid>/task/<tid>`): the scheduler's own
    count in nanoseconds (`schedstat`), not `stat`'s utime + stime. Those are per-thread
    samples of the 100 Hz tick, and a thread that runs in bursts shorter than a tick (a
    lease keep-alive: a message every 2.5 s) is charged far less than it ran: at N=100
    the simulated learners' threads read 0.35 s by ticks and 1.21 s by `schedstat` over
    the same 48 s, and the difference went to the host's figure (the process's total is
    the exact sum either way). `stat`'s ticks where `schedstat` is missing (a kernel
    without CONFIG_SCHED_INFO)."""
    try:
        return int((task_dir / "schedstat").read_text().split()[0]) / 1e9
    except (OSError, IndexError, ValueError):
        fields = (task_dir / "stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sim_thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds so far of each thread of `pid` named SIM_THREAD, by thread id."""
    found: dict[int, float] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        task_dir = Path(f"/proc/{pid}/task/{tid}")
        try:
            if (task_dir / "comm").read_text().strip() != SIM_THREAD:
                continue
            found[int(tid)] = thread_cpu(task_dir)
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
    return found


def sim_cpu_between(s0: dict[str, Any], s1: dict[str, Any]) -> float:
    """CPU seconds the simulated learners' threads used between two samples (a thread that
    ended in between is not counted: its time stays in the host's figure)."""
    before: dict[tuple[int, int], float] = s0["sim_threads"]
    return sum(cpu - before.get(key, 0.0) for key, cpu in s1["sim_threads"].items())


def steady_rates(s0: dict[str, Any], s1: dict[str, Any], n: int) -> dict[str, float]:
    """ms of CPU per alive job per second between two samples (`sample`): the daemon's,
    the guardian processes' own (their simulated learners' threads taken out) and the
    simulated learners'; where both samples read etcd's /metrics, etcd's CPU and the
    lease keep-alives it received, per alive job per second (NaN where they did not);
    the MongoDB-wire server's CPU likewise."""
    seconds = s1["at"] - s0["at"]
    sim = sim_cpu_between(s0, s1)
    per_job_s = 1000 / n / seconds
    etcd = "etcd_cpu" in s0 and "etcd_cpu" in s1
    mongo = "mongo_cpu" in s0 and "mongo_cpu" in s1
    return {
        "mongo": (s1["mongo_cpu"] - s0["mongo_cpu"]) * per_job_s if mongo else math.nan,
        "daemon": (s1["daemon_cpu"] - s0["daemon_cpu"]) * per_job_s,
        "guardian": (s1["guardian_cpu"] - s0["guardian_cpu"] - sim) * per_job_s,
        "sim": sim * per_job_s,
        "etcd": (s1["etcd_cpu"] - s0["etcd_cpu"]) * per_job_s if etcd else math.nan,
        "keepalives": (s1["etcd_keepalives"] - s0["etcd_keepalives"]) / n / seconds
        if etcd
        else math.nan,
    }


# How long after the last job reached PROCESSING the steady window opens (--settle-s).
# What the start leaves running is not the steady state: the guardians of the jobs that
# started last settle (their steps every 2 s until every learner has a status), the
# clients' re-authentications after the last etcd user was added, the LCM's and the
# scheduler's look-backs (5 s) over the start's writes. A window opened at the last
# PROCESSING holds more of that tail the faster the start ends, which made a tree that
# starts faster look costlier (benchmarks/RESULTS.md, session 14). 30 s: a safety poll's
# period, six times the look-backs; the window's halves (printed) show what is left.
SETTLE_S = 30.0


def steady_window(
    take: Callable[[], dict[str, Any]],
    settle_s: float,
    steady_s: float,
    sleep: Callable[[float], None] = time.sleep,
) -> list[dict[str, Any]]:
    """The steady window's samples (`take`): `settle_s` after now (the last job just
    reached PROCESSING), then one at the window's start, one halfway and one at its end.
    The two halves' rates say whether the window was flat (a tail still in its first
    half costs more there)."""
    sleep(settle_s)
    samples = [take()]
    for _ in range(2):
        sleep(steady_s / 2)
        samples.append(take())
    return samples


GUARDIAN_MODULES = (b"services.guardian", b"services.guardian.host")


def guardian_pids(data_dir: Path) -> list[int]:
    """The guardian processes (per job, or hosts) this platform started (their command
    line names its data dir)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        guardian = any(module in cmd for module in GUARDIAN_MODULES)
        if guardian and f"--data-dir={data_dir}".encode() in cmd:
            found.append(int(entry.name))
    return found


def sample(
    daemon_pid: int, data_dir: Path, etcd_url: str = "", mongo_pid: int = 0
) -> dict[str, Any]:
    rss, cpu = proc_stat(daemon_pid)
    guardians = guardian_pids(data_dir)
    g = [proc_stat(p) for p in guardians]
    return {
        **(etcd_load(etcd_url) if etcd_url else {}),
        **({"mongo_cpu": proc_stat(mongo_pid)[1]} if mongo_pid else {}),
        "daemon_rss": rss,
        "daemon_cpu": cpu,
        "guardians": len(guardians),
        "guardian_rss": sum(r for r, _ in g),
        "guardian_cpu": sum(c for _, c in g),
        # (pid, tid) -> CPU s of each simulated learner's thread in the guardians
        "sim_threads": {(p, tid): c for p in guardians for tid, c in sim_thread_cpu(p).items()},
        "load1": os.getloadavg()[0],
        "at": time.monotonic(),
    }


# How often `wait_all` reads the pending jobs' statuses: its reads are in the MongoDB-wire
# server's CPU of the burst (a read per job every 0.5 s was ~2,000 records a second at
# N=1,000, as many as the platform's own reads of new records).
POLL_S = 2.0


def wait_all(jobs: Any, ids: list[str], status: str, timeout_s: float) -> list[str]:
    """Wait until every job of `ids` is at `status` or has ended otherwise (a job FAILED
    by the platform is counted, not waited for); the ids of those that ended otherwise
    or were not there within `timeout_s` (the column "FAILED/late"). `jobs`: the jobs
    collection, read once every POLL_S for the pending jobs' statuses."""
    start = time.monotonic()
    pending = set(ids)
    failed: list[str] = []
    while pending:
        found = {
            str(d["_id"]): d
            for d in jobs.find(
                {"_id": {"$in": sorted(pending)}}, {"status": 1, "status_message": 1}
            )
        }
        for job_id, doc in found.items():
            if doc.get("status") == status:
                pending.discard(job_id)
            elif doc.get("status") in states.TERMINAL_STATES:
                pending.discard(job_id)
                failed.append(job_id)
                print(f"{job_id}: {doc['status']} ({doc.get('status_message')})", file=sys.stderr)
        if pending and time.monotonic() - start > timeout_s:  # reported with the failed ones
            where = ", ".join(
                f"{j}: {found[j]['status'] if j in found else 'not found'}"
                for j in sorted(pending)[:5]
            )
            print(f"{len(pending)} of {len(ids)} not {status} in time: {where}", file=sys.stderr)
            return failed + sorted(pending)
        if pending:
            time.sleep(POLL_S)
    return failed


AUTH_CALLS = ("Authenticate", "UserAdd", "UserDelete")


def etcd_metrics(url: str) -> str:
    """etcd's Prometheus /metrics (no authentication needed)."""
    return urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=10).read().decode()


def etcd_load(url: str) -> dict[str, float]:
    """What etcd has done so far that a running job costs it: its CPU seconds
    (`process_cpu_seconds_total`) and the lease keep-alives it received (the messages of
    every LeaseKeepAlive stream: the learners' leases, the hosts', the daemon's leader
    lease), from its /metrics; empty where they cannot be read."""
    try:
        return parse_etcd_load(etcd_metrics(url))
    except OSError:
        return {}


def parse_etcd_load(text: str) -> dict[str, float]:
    found = {"etcd_cpu": 0.0, "etcd_keepalives": 0.0}
    for line in text.splitlines():
        if line.startswith("process_cpu_seconds_total "):
            found["etcd_cpu"] = float(line.split()[1])
        elif line.startswith("grpc_server_msg_received_total{") and (
            'grpc_method="LeaseKeepAlive"' in line
        ):
            found["etcd_keepalives"] += float(line.rsplit(" ", 1)[1])
    return found


def etcd_auth_calls(url: str) -> dict[str, int]:
    """etcd's count of the auth calls it received so far (its Prometheus /metrics:
    `grpc_server_started_total` of etcdserverpb.Auth)."""
    text = etcd_metrics(url)
    counts = dict.fromkeys(AUTH_CALLS, 0)
    for line in text.splitlines():
        if line.startswith("grpc_server_started_total{") and "etcdserverpb.Auth" in line:
            method = re.search(r'grpc_method="(\w+)"', line)
            if method and method.group(1) in counts:
                counts[method.group(1)] += int(float(line.rsplit(" ", 1)[1]))
    return counts


HOST_REAUTH = re.compile(r"etcd re-authentications so far: host (\d+), learners (\d+)")
LCM_REAUTH = re.compile(r"lcm: etcd re-authentications so far: (\d+)")
LCM_SETUPS = re.compile(
    r"lcm: job set-ups so far: (\d+) \((\d+) failed\) and (\d+) etcd user removals in (\d+) "
    r"batches \(largest (\d+)\); ([\d.]+) s in etcd auth changes, ([\d.]+) s the rest"
)


def log_findings(data_dir: Path, daemon_log: Path) -> dict[str, int]:
    """What the hosts' and the daemon's logs say: re-authentications (the last count each
    logged), hosts that lost their lease or exited, backend calls given up on."""
    found = collections.Counter[str]()
    for path in sorted((data_dir / "guardian-hosts").glob("*.log")):
        text = path.read_text(errors="replace")
        counts = HOST_REAUTH.findall(text)
        if counts:
            found["reauth_hosts"] += int(counts[-1][0])
            found["reauth_learners"] += int(counts[-1][1])
        found["host_lease_lost"] += text.count("lost its lease")
        found["backend_timeouts"] += text.count("did not return within")
        found["revision_old"] += text.count("revision in header is old")
    text = daemon_log.read_text(errors="replace") if daemon_log.exists() else ""
    counts = LCM_REAUTH.findall(text)
    found["reauth_lcm"] = int(counts[-1]) if counts else 0
    setups = LCM_SETUPS.findall(text)  # the last report of the LCM's set-up thread
    if setups:
        names = ("setups", "setups_failed", "user_removals", "setup_batches", "largest_batch")
        for name, value in zip(names, setups[-1][:5], strict=True):
            found[name] = int(value)  # (Counter.update would count the pairs)
        found["setup_auth_changes_ms"] = int(float(setups[-1][5]) * 1000)
        found["setup_rest_ms"] = int(float(setups[-1][6]) * 1000)
    found["daemon_lost_leadership"] = text.count("lost leadership")
    found["host_exits"] = len(re.findall(r"guardian host \S+ exited with", text))
    found["hosts_started"] = text.count("started guardian host")
    rounds = re.findall(r"lcm: a round took ([\d.]+) s, ([\d.]+) s of it reading", text)
    found["slowest_lcm_round_ms"] = int(max((float(t) for t, _ in rounds), default=0.0) * 1000)
    found["slowest_lcm_read_ms"] = int(max((float(r) for _, r in rounds), default=0.0) * 1000)
    return dict(found)


def entered(repo: JobsRepository, job_id: str, status: str) -> float:
    return next(h.time for h in repo.get(job_id).history if h.status == status)


# Where submit → PROCESSING goes, stage by stage (each job's history): the scheduler
# places it (→ PENDING), the LCM sets it up and gives it to a host, whose guardian starts
# the deploy (→ DEPLOYING), the learners come up (→ PROCESSING).
STAGES = (
    ("submit", states.PENDING),
    (states.PENDING, states.DEPLOYING),
    (states.DEPLOYING, states.PROCESSING),
)


def stage_seconds(repo: JobsRepository, ids: list[str]) -> dict[str, dict[str, float]]:
    """p50/p99 seconds of each stage of `STAGES` over the jobs `ids` (PROCESSING ones)."""
    spans: dict[str, list[float]] = {f"{a}→{b}": [] for a, b in STAGES}
    for job_id in ids:
        record = repo.get(job_id)
        first: dict[str, float] = {"submit": record.created_at}
        for h in record.history:
            first.setdefault(h.status, h.time)
        for a, b in STAGES:
            if a in first and b in first:
                spans[f"{a}→{b}"].append(first[b] - first[a])
    return {
        name: {"p50": statistics.median(v), "p99": percentile(v, 0.99)}
        for name, v in spans.items()
        if v
    }


@dataclass(frozen=True)
class Plan:
    """One run: N jobs alive; a steady window of `steady_s` opened `settle_s` after the
    last PROCESSING; `per_host` guardians per host (0: a process each); at most
    `phase_timeout_s` for all PROCESSING, then for all COMPLETED; the daemon's leader
    lease `leader_ttl_s` (`rhizomed --leader-lease-ttl`) and the learners' `learner_ttl_s`
    (`manifest`)."""

    n: int
    steady_s: float
    settle_s: float
    per_host: int
    phase_timeout_s: float
    leader_ttl_s: int
    learner_ttl_s: int = DEFAULT_LEARNER_LEASE_TTL_S


def run(
    plan: Plan, thread_names: Path, tree: Path | None = None, code: str = "this tree"
) -> dict[str, Any]:
    """`plan` on the platform's code from `tree` (its packages first on the daemon's
    PYTHONPATH, which the guardians inherit) or, None, this tree's; `thread_names`, the
    directory of the SITECUSTOMIZE that names the simulated learners' threads, first on
    it either way. The row is labelled `code` ("baseline" or "this tree")."""
    os.environ[GUARDIANS_PER_HOST_ENV] = str(plan.per_host)  # the daemon inherits it
    here = os.environ.get("PYTHONPATH")
    code_path = [str(tree), str(ROOT_DIR / "gen")] if tree is not None else []
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(thread_names), *code_path, *([here] if here else [])]
    )
    try:
        row = _run(plan)
    finally:
        if here is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = here
    row["code"] = code
    return row


def _run(plan: Plan) -> dict[str, Any]:
    n, per_host, steady_s, settle_s = plan.n, plan.per_host, plan.steady_s, plan.settle_s
    print(
        f"N={n}, {per_host or 'no'} guardians per host, PYTHONPATH={os.environ.get('PYTHONPATH')}",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="rz-scale-") as tmp:
        cluster = Path(tmp) / "cluster.yaml"
        cluster.write_text(CLUSTER)
        release = Path(tmp) / "release"
        args = [
            "--backend=simulated",
            f"--cluster-config={cluster}",
            f"--leader-lease-ttl={plan.leader_ttl_s}",
        ]
        with BenchPlatform(services="api,scheduler,lcm", daemon_args=args) as platform:
            assert platform.daemon is not None and platform.daemon.pid is not None
            pid = platform.daemon.pid
            db = connect(platform.mongo.url)
            repo = JobsRepository(db)
            mongo_pid = platform.mongo.pid or 0
            before = sample(pid, platform.data_dir, mongo_pid=mongo_pid)
            etcd_url = platform.etcd.url
            auth_before = etcd_auth_calls(platform.etcd.url)
            ids: list[str] = []
            lock = threading.Lock()

            def submit(worker: int) -> None:
                with Client(platform.api, token=platform.token, tls=False) as rz:
                    for i in range(worker, n, CLIENTS):
                        job_id = rz.create_job(manifest(i, release, plan.learner_ttl_s)).job_id
                        with lock:
                            ids.append(job_id)

            t0 = time.monotonic()
            threads = [threading.Thread(target=submit, args=(w,)) for w in range(CLIENTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            submits_s = time.monotonic() - t0
            submitted = sample(pid, platform.data_dir, mongo_pid=mongo_pid)
            timeout_s = min(120 + n * 2.0, plan.phase_timeout_s)
            failed = wait_all(db["jobs"], ids, states.PROCESSING, timeout_s)
            all_processing_s = time.monotonic() - t0
            processing = sample(pid, platform.data_dir, mongo_pid=mongo_pid)
            alive = [j for j in ids if j not in failed]
            to_processing = [
                entered(repo, j, states.PROCESSING) - repo.get(j).created_at for j in alive
            ]
            stages = stage_seconds(repo, alive)
            # Steady state: N jobs alive, nothing changing, once the start's tail is over.
            print(f"all PROCESSING; the steady window opens in {settle_s:g} s", file=sys.stderr)

            def take() -> dict[str, Any]:
                taken = sample(pid, platform.data_dir, etcd_url, mongo_pid)
                if "opened" not in window_note:
                    window_note["opened"] = True
                    print(  # for a profiler run by hand meanwhile (py-spy record --pid)
                        f"steady window of {steady_s:g} s: daemon pid {pid}, guardian pids "
                        f"{guardian_pids(platform.data_dir)}",
                        file=sys.stderr,
                        flush=True,
                    )
                return taken

            window_note: dict[str, bool] = {}
            s0, s_mid, s1 = steady_window(take, settle_s, steady_s)
            # as the platform's user (etcd requires authentication): its keys are all there
            etcd = EtcdClient.connect(platform.etcd.url)
            etcd_keys = len(etcd.get_prefix(f"{ROOT}/"))
            mongo_docs = sum(db[c].count_documents({}) for c in db.list_collection_names())
            released = time.time()
            release.touch()
            t_release = time.monotonic()
            failed += wait_all(db["jobs"], alive, states.COMPLETED, timeout_s)
            all_done = time.monotonic() - t_release
            after = sample(pid, platform.data_dir)
            done = [j for j in ids if j not in failed]
            to_completed = [entered(repo, j, states.COMPLETED) - released for j in done]
            lost = [j for j in done if repo.get(j).status != states.COMPLETED]
            why_failed = collections.Counter(
                f"{r.status}: {r.status_message[:90]}" for r in map(repo.get, failed)
            )
            time.sleep(6)  # the hosts and the LCM log their counts every 5 s
            auth_after = etcd_auth_calls(platform.etcd.url)
            assert platform.daemon.log_path is not None
            findings = log_findings(platform.data_dir, Path(platform.daemon.log_path))
            # A daemon gone mid-run (its samples read 0 from then on) is what broke:
            # its last log lines say why (RHIZOME_BENCH_KEEP=1 keeps the whole log).
            # (its exit status, not /proc: this process is its parent and has not reaped
            # it, so a daemon that exited stays in /proc as a zombie)
            daemon_alive = platform.daemon.proc is not None and platform.daemon.proc.poll() is None
            last_words = (
                []
                if daemon_alive
                else Path(platform.daemon.log_path).read_text(errors="replace").splitlines()[-5:]
            )
            db.client.close()
            # Guardians end with their jobs; any left are ours to stop.
            for gpid in guardian_pids(platform.data_dir):
                os.kill(gpid, signal.SIGTERM)
    steady = steady_rates(s0, s1, n)
    halves = [steady_rates(s0, s_mid, n), steady_rates(s_mid, s1, n)]
    return {
        "mode": f"hosts of {per_host}" if per_host else "process per job",
        "n": n,
        "leader_lease_ttl_s": plan.leader_ttl_s,
        "learner_lease_ttl_s": plan.learner_ttl_s,
        "submit_to_processing_p50_s": statistics.median(to_processing),
        "submit_to_processing_p99_s": percentile(to_processing, 0.99),
        "all_processing_s": all_processing_s,
        "submits_per_s": n / submits_s,
        # the MongoDB-wire server's CPU while the N submits were made, and from the last
        # submit until all were PROCESSING, per job; and as a share of a core over each
        "mongo_submit_ms_per_job": (submitted["mongo_cpu"] - before["mongo_cpu"]) * 1000 / n,
        "mongo_start_ms_per_job": (processing["mongo_cpu"] - submitted["mongo_cpu"]) * 1000 / n,
        "mongo_submit_cores": (submitted["mongo_cpu"] - before["mongo_cpu"]) / submits_s,
        "mongo_start_cores": (processing["mongo_cpu"] - submitted["mongo_cpu"])
        / max(all_processing_s - submits_s, 1e-9),
        "daemon_burst_ms_per_job": (processing["daemon_cpu"] - before["daemon_cpu"]) * 1000 / n,
        "stages_s": stages,
        "daemon_rss_mib": s1["daemon_rss"],
        "daemon_rss_per_job_mib": (s1["daemon_rss"] - before["daemon_rss"]) / n,
        "daemon_cpu_per_job_s": (after["daemon_cpu"] - before["daemon_cpu"]) / n,
        "guardians_alive": s1["guardians"],
        "guardian_rss_per_job_mib": s1["guardian_rss"] / n,
        "guardian_cpu_per_job_s": (s1["guardian_cpu"]) / n,
        "settle_s": settle_s,
        "steady_s": s1["at"] - s0["at"],
        "steady_daemon_ms_per_job_s": steady["daemon"],
        # the guardian processes' own: their simulated learners' threads apart
        "steady_guardian_ms_per_job_s": steady["guardian"],
        "steady_sim_learners_ms_per_job_s": steady["sim"],
        # etcd's CPU and the lease keep-alives it received (learners', hosts', leader's)
        "steady_etcd_ms_per_job_s": steady["etcd"],
        "steady_keepalives_per_job_s": steady["keepalives"],
        "steady_mongo_ms_per_job_s": steady["mongo"],
        # (first half, second half) of the window: about equal when it was flat
        "steady_halves_daemon": [h["daemon"] for h in halves],
        "steady_halves_guardian": [h["guardian"] for h in halves],
        "steady_load1": [s0["load1"], s1["load1"]],
        "etcd_keys_per_job": etcd_keys / n,
        "mongo_docs_per_job": mongo_docs / n,
        "release_to_completed_p50_s": statistics.median(to_completed),
        "release_to_completed_p99_s": percentile(to_completed, 0.99),
        "all_completed_s": all_done,
        "lost_status_changes": len(lost),
        "failed_jobs": len(failed),
        "failed_why": dict(why_failed),
        "etcd_auth_calls": {k: auth_after[k] - auth_before[k] for k in AUTH_CALLS},
        "etcd_authenticate_per_job": (auth_after["Authenticate"] - auth_before["Authenticate"]) / n,
        "reauth_per_job": (
            findings.get("reauth_hosts", 0)
            + findings.get("reauth_learners", 0)
            + findings.get("reauth_lcm", 0)
        )
        / n,
        "findings": findings,
        "daemon_alive_at_end": daemon_alive,
        "daemon_last_words": last_words,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="10,25,50", help="N, comma-separated")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each size and mode; with --baseline-tree, interleaved pairs "
        "(baseline, this tree, baseline, this tree, ...)",
    )
    parser.add_argument("--steady", type=float, default=10.0, help="steady window, seconds")
    parser.add_argument(
        "--settle-s",
        type=float,
        default=SETTLE_S,
        help="seconds from the last job's PROCESSING to the steady window's start (the "
        "start's tail is not the steady state)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--modes", default="process,hosts", help="process (a guardian process per job), hosts"
    )
    parser.add_argument("--per-host", type=int, default=500, help="guardians per host (hosts)")
    parser.add_argument(
        "--phase-timeout",
        type=float,
        default=3600.0,
        help="most seconds to wait for all N PROCESSING, then for all COMPLETED (the rest: late)",
    )
    parser.add_argument(
        "--leader-lease-ttl",
        type=int,
        default=PlatformConfig().leader_lease_ttl_s,
        help="the daemon's leader lease TTL, s (rhizomed --leader-lease-ttl)",
    )
    parser.add_argument(
        "--learner-lease-ttl",
        type=int,
        default=DEFAULT_LEARNER_LEASE_TTL_S,
        help="the simulated learners' lease TTL, s (the platform's "
        "RHIZOME_LEARNER_LEASE_TTL_S default; given in each job's SIM_LEASE_TTL_S, so "
        "that a baseline tree from before that setting runs its learners at it too)",
    )
    parser.add_argument(
        "--baseline-learner-lease-ttl",
        type=int,
        default=None,
        help="the baseline runs' learners' lease TTL, s (default: --learner-lease-ttl); "
        "without --baseline-tree the baseline is this tree with its learners at this TTL",
    )
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="also run every size and mode on the code in this directory, first (same run)",
    )
    parser.add_argument(
        "--max-process-n",
        type=int,
        default=200,
        help="largest N run with a process per job (64 MiB each: 1,000 need 64 GiB)",
    )
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"process", "hosts"} or args.per_host < 1:
        parser.error("--modes is a list of process and hosts; --per-host is at least 1")
    sizes = [int(n) for n in args.sizes.split(",")]
    if args.baseline_tree is not None and not (args.baseline_tree / "services").is_dir():
        parser.error(f"--baseline-tree {args.baseline_tree}: no services/ package there")
    if args.repeat < 1:
        parser.error("--repeat is at least 1")
    if args.steady <= 0 or args.settle_s < 0:
        parser.error("--steady is above 0 and --settle-s at least 0")
    if args.baseline_learner_lease_ttl is not None and args.baseline_learner_lease_ttl < 2:
        parser.error("--baseline-learner-lease-ttl is at least 2 (etcd's shortest lease)")
    # (tree, learners' lease TTL, label) of each run of a size: the baseline first
    variants: list[tuple[Path | None, int, str]] = [(None, args.learner_lease_ttl, "this tree")]
    compared = args.baseline_tree is not None or args.baseline_learner_lease_ttl is not None
    if compared:
        base_tree = args.baseline_tree.resolve() if args.baseline_tree is not None else None
        base_ttl = args.baseline_learner_lease_ttl or args.learner_lease_ttl
        variants.insert(0, (base_tree, base_ttl, "baseline"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="rz-scale-threads-") as thread_names:
        (Path(thread_names) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        for n in sizes:
            for mode in modes:
                if mode == "hosts" or n <= args.max_process_n:
                    per_host = args.per_host if mode == "hosts" else 0
                    for _ in range(args.repeat):
                        for tree, learner_ttl, code in variants:
                            plan = Plan(
                                n,
                                args.steady,
                                args.settle_s,
                                per_host,
                                args.phase_timeout,
                                args.leader_lease_ttl,
                                learner_ttl,
                            )
                            rows.append(run(plan, Path(thread_names), tree, code))
                            # kept if cut short
                            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"\n{os.cpu_count()} cores, shared; simulated learners (train nothing)")
    print(
        "steady guardian ms/job/s: the guardian processes' own CPU, their simulated "
        "learners' threads (lease keep-alives, SIM_UNTIL_FILE poller) counted apart in "
        "'steady sim learners ms/job/s'; guardian CPU s/job (whole run) includes them; "
        "a thread's CPU is the scheduler's count (/proc/<pid>/task/<tid>/schedstat)"
    )
    print(
        f"steady window: {args.steady:g} s, opened {args.settle_s:g} s after the last job "
        "was PROCESSING (--settle-s); 'halves': its first and second half\n"
    )
    cols = [
        ("code", "code", "{}"),
        ("learner lease s", "learner_lease_ttl_s", "{}"),
        ("mode", "mode", "{}"),
        ("N", "n", "{:.0f}"),
        ("submit→PROC p50 s", "submit_to_processing_p50_s", "{:.2f}"),
        ("p99 s", "submit_to_processing_p99_s", "{:.2f}"),
        ("daemon RSS MiB", "daemon_rss_mib", "{:.0f}"),
        ("daemon MiB/job", "daemon_rss_per_job_mib", "{:.2f}"),
        ("daemon CPU s/job", "daemon_cpu_per_job_s", "{:.3f}"),
        ("guardian procs", "guardians_alive", "{:.0f}"),
        ("guardian MiB/job", "guardian_rss_per_job_mib", "{:.2f}"),
        ("guardian CPU s/job", "guardian_cpu_per_job_s", "{:.3f}"),
        ("steady daemon ms/job/s", "steady_daemon_ms_per_job_s", "{:.2f}"),
        ("steady guardian ms/job/s", "steady_guardian_ms_per_job_s", "{:.2f}"),
        ("steady sim learners ms/job/s", "steady_sim_learners_ms_per_job_s", "{:.2f}"),
        ("steady etcd ms/job/s", "steady_etcd_ms_per_job_s", "{:.2f}"),
        ("keep-alives/job/s", "steady_keepalives_per_job_s", "{:.2f}"),
        ("submits/s", "submits_per_s", "{:.0f}"),
        ("mongo submit ms/job", "mongo_submit_ms_per_job", "{:.2f}"),
        ("mongo start ms/job", "mongo_start_ms_per_job", "{:.2f}"),
        ("mongo cores submit", "mongo_submit_cores", "{:.2f}"),
        ("mongo cores start", "mongo_start_cores", "{:.2f}"),
        ("daemon burst ms/job", "daemon_burst_ms_per_job", "{:.1f}"),
        ("steady mongo ms/job/s", "steady_mongo_ms_per_job_s", "{:.3f}"),
        ("guardian halves", "steady_halves_guardian", "{0[0]:.2f}/{0[1]:.2f}"),
        ("daemon halves", "steady_halves_daemon", "{0[0]:.2f}/{0[1]:.2f}"),
        ("load1 steady", "steady_load1", "{0[0]:.1f}-{0[1]:.1f}"),
        ("etcd keys/job", "etcd_keys_per_job", "{:.1f}"),
        ("mongo docs/job", "mongo_docs_per_job", "{:.2f}"),
        ("release→COMPLETED p99 s", "release_to_completed_p99_s", "{:.2f}"),
        ("lost", "lost_status_changes", "{:.0f}"),
        ("FAILED/late", "failed_jobs", "{:.0f}"),
        ("etcd Authenticate/job", "etcd_authenticate_per_job", "{:.1f}"),
        ("re-auth/job", "reauth_per_job", "{:.1f}"),
    ]
    print(" | ".join(c for c, _, _ in cols))
    for row in rows:
        print(" | ".join(fmt.format(row[key]) for _, key, fmt in cols))
    if compared:
        compare_trees(rows)
    mine = [r for r in rows if r["code"] == "this tree"]
    by_mode = {mode: [r for r in mine if r["mode"].startswith(mode[:4])] for mode in modes}
    if len(modes) == 2:
        print("\nhosts against a process per job, same N, same run:")
        hosts_by_n = {r["n"]: r for r in by_mode["hosts"]}
        for proc_row in by_mode["process"]:
            host_row = hosts_by_n[proc_row["n"]]
            print(
                f"  N={proc_row['n']}: guardian MiB/job "
                f"x{ratio(host_row, proc_row, 'guardian_rss_per_job_mib'):.3f}, guardian CPU s/job "
                f"x{ratio(host_row, proc_row, 'guardian_cpu_per_job_s'):.3f}, steady guardian "
                f"ms/job/s x{ratio(host_row, proc_row, 'steady_guardian_ms_per_job_s'):.3f}, "
                f"submit→PROCESSING p99 "
                f"x{ratio(host_row, proc_row, 'submit_to_processing_p99_s'):.2f}"
            )
    for mode in modes:
        if by_mode[mode]:
            report(by_mode[mode])
    print("\nwhere submit→PROCESSING goes (p50 / p99 s of each stage):")
    for row in rows:
        parts = ", ".join(
            f"{name} {v['p50']:.2f} / {v['p99']:.2f}" for name, v in row["stages_s"].items()
        )
        print(
            f"  {row['code']}, {row['mode']} N={row['n']}: {parts}; all PROCESSING after {row['all_processing_s']:.1f} s"
        )
    print("\nwhat went wrong, and the etcd authentication storm:")
    for row in rows:
        print(
            f"  {row['code']}, {row['mode']} N={row['n']}: etcd auth calls {row['etcd_auth_calls']}; "
            f"logs {row['findings']}; FAILED/late by reason {row['failed_why'] or 'none'}"
        )
        if not row["daemon_alive_at_end"]:
            print(
                f"  {row['code']}, {row['mode']} N={row['n']}: THE DAEMON EXITED during the run; its last lines:"
            )
            for line in row["daemon_last_words"]:
                print(f"    {line[:200]}")
    if args.json:
        print(json.dumps(rows, indent=2))


def compare_trees(rows: list[dict[str, Any]]) -> None:
    """This tree's figures against the baseline tree's, same N and mode, same run: each
    pair (the k-th baseline run with the k-th of this tree), then with several pairs the
    median of each figure and of each pair's ratio."""
    print("\nthis tree against the baseline (tree or learners' lease), same N and mode, same run:")
    groups: dict[tuple[str, int], dict[str, list[dict[str, Any]]]] = {}
    for row in rows:
        group = groups.setdefault((row["mode"], row["n"]), {"baseline": [], "this tree": []})
        group[row["code"]].append(row)
    for (mode, n), group in groups.items():
        pairs = list(zip(group["baseline"], group["this tree"], strict=False))
        for k, (base, row) in enumerate(pairs, 1):
            both = {r["code"]: steady_both(r) for r in (base, row)}
            print(
                f"  {mode} N={n} pair {k} (learners' lease {base['learner_lease_ttl_s']} -> "
                f"{row['learner_lease_ttl_s']} s): steady ms of CPU per alive job per second: daemon "
                f"{base['steady_daemon_ms_per_job_s']:.3f} -> {row['steady_daemon_ms_per_job_s']:.3f} "
                f"(x{ratio(row, base, 'steady_daemon_ms_per_job_s'):.3f}), guardian hosts' own "
                f"{base['steady_guardian_ms_per_job_s']:.3f} -> "
                f"{row['steady_guardian_ms_per_job_s']:.3f} "
                f"(x{ratio(row, base, 'steady_guardian_ms_per_job_s'):.3f}), both "
                f"{both['baseline']:.3f} -> {both['this tree']:.3f} "
                f"(x{both['this tree'] / both['baseline'] if both['baseline'] else float('inf'):.3f}); "
                f"sim learners apart {base['steady_sim_learners_ms_per_job_s']:.3f} -> "
                f"{row['steady_sim_learners_ms_per_job_s']:.3f}; etcd "
                f"{base['steady_etcd_ms_per_job_s']:.3f} -> {row['steady_etcd_ms_per_job_s']:.3f} "
                f"(keep-alives/job/s {base['steady_keepalives_per_job_s']:.2f} -> "
                f"{row['steady_keepalives_per_job_s']:.2f}); MongoDB-wire server: submits "
                f"{base['mongo_submit_ms_per_job']:.2f} -> {row['mongo_submit_ms_per_job']:.2f} "
                f"ms/job (x{ratio(row, base, 'mongo_submit_ms_per_job'):.3f}; "
                f"{base['mongo_submit_cores']:.2f} -> {row['mongo_submit_cores']:.2f} cores), "
                f"start {base['mongo_start_ms_per_job']:.2f} -> "
                f"{row['mongo_start_ms_per_job']:.2f} ms/job "
                f"(x{ratio(row, base, 'mongo_start_ms_per_job'):.3f}; "
                f"{base['mongo_start_cores']:.2f} -> {row['mongo_start_cores']:.2f} cores), "
                f"steady {base['steady_mongo_ms_per_job_s']:.3f} -> "
                f"{row['steady_mongo_ms_per_job_s']:.3f} ms/job/s; daemon in the burst "
                f"{base['daemon_burst_ms_per_job']:.1f} -> {row['daemon_burst_ms_per_job']:.1f} "
                f"ms/job; submit→PROCESSING p50 {base['submit_to_processing_p50_s']:.2f} -> "
                f"{row['submit_to_processing_p50_s']:.2f} s; hosts' own by half "
                f"{halves(base['steady_halves_guardian'])} -> "
                f"{halves(row['steady_halves_guardian'])}; load1 "
                f"{base['steady_load1'][0]:.1f}-{base['steady_load1'][1]:.1f} -> "
                f"{row['steady_load1'][0]:.1f}-{row['steady_load1'][1]:.1f}; "
                f"submit→PROCESSING p99 {base['submit_to_processing_p99_s']:.2f} -> "
                f"{row['submit_to_processing_p99_s']:.2f} s; release→COMPLETED p99 "
                f"{base['release_to_completed_p99_s']:.2f} -> {row['release_to_completed_p99_s']:.2f} s; "
                f"lost {base['lost_status_changes']} -> {row['lost_status_changes']}, FAILED/late "
                f"{base['failed_jobs']} -> {row['failed_jobs']}"
            )
        if len(pairs) > 1:
            med = statistics.median
            parts = []
            for name, key in (
                ("daemon", "steady_daemon_ms_per_job_s"),
                ("guardian hosts' own", "steady_guardian_ms_per_job_s"),
                ("mongo submit ms/job", "mongo_submit_ms_per_job"),
                ("mongo start ms/job", "mongo_start_ms_per_job"),
                ("steady mongo", "steady_mongo_ms_per_job_s"),
            ):
                parts.append(
                    f"{name} {med(b[key] for b, _ in pairs):.3f} -> "
                    f"{med(r[key] for _, r in pairs):.3f} "
                    f"(pair ratios x{med(ratio(r, b, key) for b, r in pairs):.3f}, "
                    f"from x{min(ratio(r, b, key) for b, r in pairs):.3f} "
                    f"to x{max(ratio(r, b, key) for b, r in pairs):.3f})"
                )
            both_ratio = med(
                steady_both(r) / steady_both(b) if steady_both(b) else float("inf")
                for b, r in pairs
            )
            print(
                f"  {mode} N={n}, median of {len(pairs)} pairs: " + ", ".join(parts) + ", both "
                f"{med(steady_both(b) for b, _ in pairs):.3f} -> "
                f"{med(steady_both(r) for _, r in pairs):.3f} (pair ratios x{both_ratio:.3f})"
            )


def halves(pair: list[float]) -> str:
    return f"{pair[0]:.3f}/{pair[1]:.3f}"


def steady_both(row: dict[str, Any]) -> float:
    """Steady CPU per alive job per second of the daemon and the guardians' own."""
    return float(row["steady_daemon_ms_per_job_s"] + row["steady_guardian_ms_per_job_s"])


def ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float:
    return float(a[key]) / float(b[key]) if b[key] else float("inf")


def report(rows: list[dict[str, Any]]) -> None:
    """Within one mode: cost per job at the largest N against the smallest, and what a
    10,000-job run would need."""
    print(f"\n{rows[0]['mode']}:")
    small, large = rows[0], rows[-1]

    cpu_ratio = (large["daemon_cpu_per_job_s"] + large["guardian_cpu_per_job_s"]) / (
        small["daemon_cpu_per_job_s"] + small["guardian_cpu_per_job_s"]
    )
    mem_per_job = large["guardian_rss_per_job_mib"] + large["daemon_rss_per_job_mib"]
    total_mib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20
    print(
        f"  CPU per job at N={large['n']} vs N={small['n']}: {cpu_ratio:.2f}x "
        f"(goal <= 1.2x: {'met' if cpu_ratio <= 1.2 else 'NOT met'})"
    )
    print(
        f"  memory per alive job: {mem_per_job:.2f} MiB -> 10,000 jobs need "
        f"{mem_per_job * 10_000 / 1024:.0f} GiB; this machine has {total_mib / 1024:.0f} GiB, "
        f"so it holds about {total_mib / mem_per_job:.0f} jobs alive (what breaks first)"
    )
    platform_ms = steady_both(large)
    print(
        f"  steady CPU per alive job at N={large['n']}: daemon "
        f"{large['steady_daemon_ms_per_job_s']:.3f} + guardians' own "
        f"{large['steady_guardian_ms_per_job_s']:.3f} ms/s -> {platform_ms * 10:.1f} cores "
        f"for 10,000 jobs if it stays flat, before etcd and MongoDB (the simulated "
        f"learners' {large['steady_sim_learners_ms_per_job_s']:.3f} apart)"
    )
    lost = sum(r["lost_status_changes"] for r in rows)
    print(f"  lost status changes: {lost}")


if __name__ == "__main__":
    main()
