"""Pipeline jobs on the platform vs the bare launcher, failover and reconfiguration pauses.

    .venv/bin/python benchmarks/pipeline_platform.py [--steps 120] [--layers 4 --dim 64]
        [--rounds 5] [--no-pin] [--throughput-only] [--show-every S | --poll-show]
    .venv/bin/python benchmarks/pipeline_platform.py --steady 200 [--rounds 2]
        [--idle-s 10] [--settle-s 20] [--after-settle-s 5] [--threads] [--baseline-tree DIR]

One run measures, on this machine, the same job (examples/pipeline-gpt, 2 stages × 1
pipeline, 4 microbatches, a block checkpoint every 10 steps in both):

1. **bare**: `python -m learner.runtime.launch` (a private etcd, the launcher's TCPStore);
2. **platform**: `rhizome up --embedded` + `rhizome train` (each learner one worker, the
   rendezvous store in the platform's etcd);

throughput = steps per second over the steady steps (the last stage's `step ... time T`
lines, the first 5 steps left out: start-up is not throughput; the same window, steps 6
to N of the worker's own step timer, for the bare and the platform run), and the ratio
platform / bare (goal ≥ 0.97). The two are interleaved over `--rounds` rounds, the order
alternating (bare first in even rounds, platform first in odd ones), so that a change in
the machine's load hits both alike; the embedded platform is started once, before the
first round, and stays up (idle) during the bare runs too, so what the ratio shows is
what running a job through it costs, not its servers' idle load. Each round's ratio
pairs that round's two runs; printed: every round, the median ratio, its range, and how
far the bare runs alone spread (max / min). With pinning (the default) every worker —
bare or on the platform — pins itself to core `worker % cores` before it imports
anything (`pin.py`, a shim in front of train.py), so both runs put the stages on the
same cores.

Where the time goes: each run is profiled (`CpuProfile`: CPU seconds, user + system, of
every process of the run by kind, from /proc every 0.2 s: the launcher's process tree for
the bare run; everything whose command line or working directory is under the
platform's data directory for the platform job: workers, controllers, guardian, daemon,
etcd, MongoDB-wire, Elasticsearch-API, the `rhizome` CLI), printed under each round.
While the platform job trains it is watched through its learners' files only; its
status is read (`rhizome show`) once they show that it ended, or when they stop changing
for 30 s (a job that failed early): a user's client runs on their own machine, not on
the two cores the pinned workers use, and the bare run is watched by nobody. Until
session 10 a `rhizome show` ran every 10 s throughout (0.3-0.7 CPU s a round, a share
of the steady steps' cores; `--show-every 10` measures that way again); `--poll-show`
starts one every second, as before session 9.

3. **failover and reconfiguration** (launcher, `--replace`, a private etcd): worker 1 is
   SIGKILLed from outside at step 30; a replacement starts and joins. From the step
   lines: the pause of the step the failover happened in and of the step the
   reconfiguration happened in, in iterations ((step time − median) / median; goals < 1
   and < 2), and from the launcher's stderr, read line by line as it comes, the seconds
   from the kill to the survivors' new generation and to redundancy restored (the
   replacement's "joined generation ... (reconfiguration)": it includes the
   replacement's process start, torch import and model build).

4. **steady cost** (`--steady N`): what the platform spends per second of a running job,
   in CPU seconds (load-independent, unlike steps/s on a shared machine). Per round: the
   embedded platform is started, left `--settle-s` seconds (its start-up), sampled idle
   for `--idle-s` seconds, then one N-step job runs and the platform is sampled over its
   steady phase only (from the last stage's step 20 to step N-10, read from its
   stdout.log as it grows: deploy and the end are left out), then, once the job's
   processes are gone and `--after-settle-s` more passed, idle again for `--idle-s`
   seconds. The window after the job is the baseline (since session 12): the one before
   it still held the platform's first minute (session 11: every process busier than in
   the steady phase, after 15 s of settling). Printed per kind of process: CPU s per wall
   second idle (before / after the job), during the steady phase, and steady minus idle
   after (what the running job costs the platform), plus etcd's requests per second by
   method (its /metrics) over the idle-after and steady windows. With
   `--baseline-tree DIR` (a checkout of another commit, e.g. `git archive BASE | tar -x
   -C DIR` plus this tree's gen/) every round runs the platform from DIR and from this
   tree (or `--tree DIR2`), the order alternating, so a change is measured before and
   after in one run. Another tree's code runs through `PYTHONPATH` (the daemon, guardian
   and controllers inherit it; the learners' interpreter wrapper keeps it). `--threads`
   also prints every platform thread's CPU s per second, idle and steady (`/proc/<pid>/
   task`), named by `py-spy dump` when py-spy is installed in the venv (else the
   thread's comm): which thread of which process a running job costs.

The simulator comparison under the p3 trace (issue #16) is benchmarks/pipeline_trace.py.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from _platform import rz

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "pipeline-gpt"
STEP = re.compile(r"^step (\d+) loss \S+ generation (\d+) time (\S+)")


def steady_throughput(stdout: str, skip: int = 5) -> tuple[float, list[float]]:
    """Steps per second over the steady steps, and every step's time (by step)."""
    times: dict[int, float] = {}
    for line in stdout.splitlines():
        m = STEP.match(line.strip())
        if m:
            times[int(m.group(1))] = float(m.group(3))
    ordered = [times[s] for s in sorted(times)]
    steady = ordered[skip:]
    return len(steady) / sum(steady), ordered


# What a process is, from its command line (the first match names it: the launcher's
# and the CLI's name the training script too).
KINDS = (
    ("learner.runtime.launch", "launcher"),
    ("services.client.cli", "rhizome CLI"),
    ("learner.controller", "controllers"),
    ("services.guardian", "guardian"),
    ("services.daemon", "daemon"),
    ("services.embedded.supervisor", "supervisor"),
    ("train.py", "workers"),
    ("secantus", "mongo-wire"),
    ("etcd", "etcd"),
    ("elastic", "elasticsearch-api"),
)
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def kind_of(argv: str) -> str:
    return next((k for pattern, k in KINDS if pattern in argv), argv.split(" ")[0][-30:])


class Proc(NamedTuple):
    pid: int
    ppid: int
    start: int  # start time in ticks since boot: with pid, names the process
    argv: str  # the command line, space-separated ("" once it exited, not yet reaped)
    cpu_s: float  # user + system so far


def processes() -> Iterator[Proc]:
    """Every process /proc lists now (one gone while it is read is left out)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu_s = (int(fields[11]) + int(fields[12])) * TICK_S
        yield Proc(pid, int(fields[1]), int(fields[19]), argv, cpu_s)


class CpuProfile:
    """CPU seconds (user + system) per kind of process while a run goes on: a process
    counts if its command line or working directory holds `marker` (the platform's data
    directory) or it descends from `root` (the bare launcher). Sampled every 0.2 s from
    /proc, each process's last reading kept (workers end before the run does)."""

    def __init__(self, marker: str = "", root: int = 0) -> None:
        self.marker, self.root = marker, root
        self.first: dict[tuple[int, int], float] = {}
        self.last: dict[tuple[int, int], tuple[str, float]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuProfile:
        self._sample(first=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self._sample()

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            self._sample()

    def _sample(self, first: bool = False) -> None:
        parents: dict[int, int] = {}
        seen: dict[int, tuple[int, str, float]] = {}
        for proc in processes():
            parents[proc.pid] = proc.ppid
            seen[proc.pid] = (proc.start, proc.argv, proc.cpu_s)
        for pid, (start, argv, cpu) in seen.items():
            mine = bool(self.marker) and (self.marker in argv or self.marker in cwd_of(pid))
            up, hops = pid, 0
            while not mine and self.root and up > 1 and hops < 64:
                mine, up, hops = up == self.root, parents.get(up, 0), hops + 1
            if not mine:
                continue
            key = (pid, start)
            if first:
                self.first[key] = cpu
            # an exited process not yet reaped has no command line: keep what it was
            kind = self.last[key][0] if key in self.last and not argv.strip() else kind_of(argv)
            self.last[key] = (kind, cpu)

    def seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, (kind, cpu) in self.last.items():
            out[kind] = out.get(kind, 0.0) + cpu - self.first.get(key, 0.0)
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def cwd_of(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""


def script_args(a: argparse.Namespace) -> list[str]:
    return ["--steps", str(a.steps), "--layers", str(a.layers), "--dim", str(a.dim)]


# In front of the training script: the worker pins itself to one core (its worker number
# modulo the cores it may use), then runs the script as `python train.py ...` would.
PIN = """
import os, runpy, sys
cores = sorted(os.sched_getaffinity(0))
worker = int(os.environ.get("RHIZOME_RUNTIME_WORKER", "0"))
os.sched_setaffinity(0, {cores[worker % len(cores)]})
script = os.path.abspath(sys.argv[1])
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
"""


def entry(a: argparse.Namespace, code: Path) -> list[str]:
    """The script and its arguments, behind the pinning shim when pinning."""
    if not a.pin:
        return [str(code / "train.py"), *script_args(a)]
    (code / "pin.py").write_text(PIN)
    return [str(code / "pin.py"), str(code / "train.py"), *script_args(a)]


def bare(a: argparse.Namespace) -> tuple[float, dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="rhizome-bench-bare-") as tmp:
        code = Path(tmp) / "code"
        shutil.copytree(GPT, code)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "learner.runtime.launch",
                "--stages",
                "2",
                "--etcd",
                "auto",
                # the platform's default: a block checkpoint every 10 steps (a fresh
                # directory: a run finding checkpoints would start from them)
                "--checkpoint-dir",
                str(Path(tmp) / "checkpoints"),
                "--checkpoint-every",
                "10",
                *entry(a, code),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        with CpuProfile(root=proc.pid) as profile:
            out, err = proc.communicate(timeout=900)
    if proc.returncode != 0:
        sys.exit(f"bare run failed:\n{err[-3000:]}")
    return steady_throughput(out)[0], profile.seconds()


def platform_job(a: argparse.Namespace, data_dir: Path, n: int) -> tuple[float, dict[str, float]]:
    """One job through the running embedded platform in `data_dir`; its throughput and
    the CPU seconds of the platform's processes while it ran (CpuProfile)."""
    code = data_dir / f"code-{n}"
    shutil.copytree(GPT, code)
    # the command runs in the learner's code directory: the script's relative names
    args = [Path(x).name if x.startswith(str(code)) else x for x in entry(a, code)]
    manifest = (code / "manifest.yaml").read_text()
    manifest = re.sub(r"command: python train.py.*", f"command: python {' '.join(args)}", manifest)
    (code / "manifest.yaml").write_text(manifest)
    with CpuProfile(marker=str(data_dir)) as profile:
        job_id = json.loads(rz(data_dir, "train", str(code / "manifest.yaml"), "--json"))["job_id"]
        job = wait_end(a, data_dir, job_id)
    if job["status"] != "COMPLETED":
        tails = "\n".join(
            f"learner {r.name}: " + " | ".join((r / "stderr.log").read_text().splitlines()[-4:])
            for r in sorted((data_dir / "jobs" / job_id / "learners").iterdir())
            if (r / "stderr.log").exists()
        )
        sys.exit(f"platform job ended {job['status']}: {job['status_message']}\n{tails}")
    out = (data_dir / "jobs" / job_id / "learners" / "1" / "stdout.log").read_text()
    return steady_throughput(out)[0], profile.seconds()


# With nothing under the job's learner directories changing for this long, its status is
# read: a job that failed before its workers wrote anything, or that never deployed.
STALL_S = 30.0


def learner_files(learners: Path) -> tuple[tuple[str, int], ...]:
    """Name and size of every file in the job's learner directories (what changes while
    the workers train: their logs, a command's exit file)."""
    found: list[tuple[str, int]] = []
    try:
        for rank in os.scandir(learners):
            if rank.is_dir():
                for f in os.scandir(rank.path):
                    with contextlib.suppress(OSError):
                        found.append((f.path, f.stat().st_size))
    except OSError:
        pass  # not deployed yet
    return tuple(sorted(found))


def wait_end(a: argparse.Namespace, data_dir: Path, job_id: str) -> dict[str, Any]:
    """The job once it ended (`rhizome show`). While the workers train, its status is not
    read: a status read is a `rhizome` CLI process (0.3-0.7 CPU s: its imports) on the two
    cores the pinned workers use, which the bare run, watched by nobody, does not pay, and
    a user's client runs on their own machine. Only the names and sizes of the learners'
    files are read (in this process), and the status once both workers' commands exited
    (each controller's `exit-*` file), or when nothing in the learner directories changed
    for STALL_S (a job that failed early or never deployed). Until
    session 10 a `rhizome show` ran every 10 s throughout (`--show-every 10` does that
    again); `--poll-show` starts one every second, as this benchmark did before that."""
    learners = data_dir / "jobs" / job_id / "learners"
    deadline = time.monotonic() + 900
    last_show = time.monotonic()  # the submit (`rhizome train`) was the last status read
    seen, changed_at = learner_files(learners), last_show
    while True:
        now = time.monotonic()
        if a.poll_show:
            due = True
        else:
            files = learner_files(learners)
            if files != seen:
                seen, changed_at = files, now
            exited = {Path(n).parent.name for n, _ in files if Path(n).name.startswith("exit-")}
            due = (
                exited >= {"0", "1"}
                or (a.show_every > 0 and now - last_show >= a.show_every)
                or now - max(changed_at, last_show) >= STALL_S
            )
        if due and now - last_show >= 1.0:
            job: dict[str, Any] = json.loads(rz(data_dir, "show", job_id, "--json"))
            if job["status"] in ("COMPLETED", "FAILED", "HALTED", "DELETED"):
                return job
            last_show = time.monotonic()
        if time.monotonic() > deadline:
            sys.exit(f"platform job {job_id} did not end")
        time.sleep(0.2)


Round = tuple[float, float, dict[str, float], dict[str, float], str]


def interleaved(a: argparse.Namespace) -> list[Round]:
    """(bare, platform) steps/s and CPU seconds by process kind per round, the order
    alternating; the platform up throughout."""
    data_dir = Path(tempfile.mkdtemp(prefix="rhizome-bench-pipe-"))
    rz(data_dir, "up", "--embedded", "--grpc-port", "0", "--rest-port", "0")
    rounds: list[Round] = []
    try:
        for n in range(a.rounds):
            if n % 2 == 0:
                b, bcpu = bare(a)
                p, pcpu = platform_job(a, data_dir, n)
            else:
                p, pcpu = platform_job(a, data_dir, n)
                b, bcpu = bare(a)
            now = load()  # the machine is shared: a ratio is read with the load beside it
            print(
                f"round {n + 1}: bare {b:.2f} steps/s, platform {p:.2f} steps/s, ratio "
                f"{p / b:.3f}, load {now}",
                file=sys.stderr,
            )
            rounds.append((b, p, bcpu, pcpu, now))
    finally:
        rz(data_dir, "down")
        shutil.rmtree(data_dir, ignore_errors=True)
    return rounds


# -- steady cost: CPU per second of a running job (--steady) --------------------------------
ProcKey = tuple[int, int]  # (pid, start time in ticks): a pid reused later is another process
STEADY_FROM = 20  # the steady phase starts at this step of the last stage...
STEADY_TAIL = 10  # ...and ends this many steps before the last


def platform_cpu(marker: str) -> dict[ProcKey, tuple[str, float]]:
    """Kind and CPU seconds so far of every process whose command line or working
    directory holds `marker` (the platform's data directory), as CpuProfile counts them."""
    out: dict[ProcKey, tuple[str, float]] = {}
    for proc in processes():
        if marker in proc.argv or marker in cwd_of(proc.pid):
            out[(proc.pid, proc.start)] = (kind_of(proc.argv), proc.cpu_s)
    return out


def cpu_between(
    before: dict[ProcKey, tuple[str, float]], after: dict[ProcKey, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds by kind spent between two `platform_cpu` readings (a process started
    in between counts from zero; one that ended in between is not seen: the windows
    measured have no process starting or ending but the job's own)."""
    out: dict[str, float] = {}
    for key, (kind, cpu) in after.items():
        out[kind] = out.get(kind, 0.0) + cpu - before.get(key, (kind, 0.0))[1]
    return out


def etcd_url(marker: str) -> str:
    """The platform's etcd client URL, from its command line."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if any(marker in x for x in argv) and any("etcd" in x for x in argv[:1]):
            for x in argv:
                if x.startswith("--advertise-client-urls="):
                    return x.split("=", 1)[1]
    return ""


ETCD_MSG = re.compile(r'^grpc_server_msg_received_total\{.*grpc_method="(\w+)".*\} (\S+)$')


def etcd_requests(url: str) -> dict[str, float]:
    """etcd's gRPC messages received so far by method (unary requests and stream
    messages: a watch's or a keep-alive stream's), from its /metrics; {} if unreachable."""
    if not url:
        return {}
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = ETCD_MSG.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


@dataclass
class Window:
    """What the platform spent over `seconds` of wall time: CPU s by kind, etcd messages."""

    seconds: float
    cpu: dict[str, float]
    etcd: dict[str, float]

    def per_s(self) -> dict[str, float]:
        return {k: v / self.seconds for k, v in self.cpu.items()}

    def etcd_per_s(self) -> dict[str, float]:
        return {k: v / self.seconds for k, v in self.etcd.items()}


ThreadKey = tuple[int, int, int]  # (pid, process start, tid)


def thread_cpu(procs: dict[ProcKey, tuple[str, float]]) -> dict[ThreadKey, float]:
    """CPU seconds so far of every thread of `procs` (a `platform_cpu` reading)."""
    out: dict[ThreadKey, float] = {}
    for pid, start in procs:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            out[(pid, start, int(tid))] = (int(fields[11]) + int(fields[12])) * TICK_S
    return out


PY_SPY_THREAD = re.compile(r'^Thread (0x[0-9A-Fa-f]+|\d+) \(\w+\): "(.*)"$')


def thread_names(pid: int) -> dict[int, str]:
    """tid -> Python thread name, from `py-spy dump` (next to this interpreter); {} without
    py-spy. Threads py-spy does not list (grpc's, etcd's Go threads) keep their comm."""
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        return {}
    try:
        out = subprocess.run(
            [str(spy), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    names: dict[int, str] = {}
    for line in out.splitlines():
        m = PY_SPY_THREAD.match(line.strip())
        if m:
            raw = m.group(1)
            names[int(raw, 16) if raw.startswith("0x") else int(raw)] = m.group(2)
    return names


def thread_label(pid: int, tid: int, names: dict[int, dict[int, str]]) -> str:
    name = names.get(pid, {}).get(tid)
    if name:
        return name
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return f"tid {tid}"


class Reading:
    """One moment's `platform_cpu` and `etcd_requests` (and, with `threads`, every
    platform thread's CPU)."""

    def __init__(self, marker: str, url: str, threads: bool = False) -> None:
        self.at = time.monotonic()
        self.cpu = platform_cpu(marker)
        self.etcd = etcd_requests(url)
        self.threads = thread_cpu(self.cpu) if threads else {}

    def since(self, earlier: Reading) -> Window:
        etcd = {k: v - earlier.etcd.get(k, 0.0) for k, v in self.etcd.items()}
        return Window(
            self.at - earlier.at,
            cpu_between(earlier.cpu, self.cpu),
            {k: v for k, v in etcd.items() if v > 0},
        )


def last_step(stdout_log: Path) -> int:
    """The highest step the last stage has printed so far (-1: none yet)."""
    try:
        text = stdout_log.read_text()
    except OSError:
        return -1
    steps = [int(m.group(1)) for m in map(STEP.match, text.splitlines()) if m]
    return max(steps, default=-1)


Cli = Callable[..., str]


def tree_cli(tree: Path) -> Cli:
    """`rhizome` run from another checkout (`rz`'s `tree`)."""
    return functools.partial(rz, tree=tree)


def thread_lines(
    idle: tuple[Reading, Reading], steady: tuple[Reading, Reading], names: dict[int, dict[int, str]]
) -> list[str]:
    """Per thread of every platform process, CPU s per second idle and over the job's
    steady phase, the busiest first (--threads)."""
    kinds = {key: kind for key, (kind, _) in steady[1].cpu.items()}

    def rates(pair: tuple[Reading, Reading]) -> dict[ThreadKey, float]:
        span = pair[1].at - pair[0].at
        return {k: (v - pair[0].threads.get(k, 0.0)) / span for k, v in pair[1].threads.items()}

    i, s = rates(idle), rates(steady)
    rows = []
    for key, rate in s.items():
        kind = kinds.get((key[0], key[1]), "?")
        if kind not in PLATFORM_KINDS:
            continue
        job = rate - i.get(key, 0.0)
        if abs(job) >= 0.0003 or rate >= 0.0005:
            label = thread_label(key[0], key[2], names)
            rows.append(
                (
                    job,
                    f"    {kind:<12} pid {key[0]:<7} {label[:28]:<28} idle "
                    f"{i.get(key, 0.0):.4f}  steady {rate:.4f}  job {job:+.4f}",
                )
            )
    return ["  per thread (CPU s/s; idle: the window after the job; job = steady - idle):"] + [
        line for _, line in sorted(rows, key=lambda r: -r[0])
    ]


def job_processes_gone(marker: str) -> bool:
    """Whether every process of the job (its guardian, controllers and workers) ended."""
    kinds = {kind for kind, _ in platform_cpu(marker).values()}
    return not kinds & {"guardian", "controllers", "workers"}


def steady_round(a: argparse.Namespace, cli: Cli) -> tuple[Window, Window, Window, float]:
    """A fresh embedded platform (run by `cli`): idle for `a.idle_s`, one job of
    `a.steady` steps, then idle again for `a.idle_s` once the job's processes are gone and
    `a.after_settle_s` passed; the idle window before the job, the one after it, the job's
    steady window and its steps/s. The window after is the baseline: the one before
    still held the platform's first minute (session 11: 0.09-0.13 CPU s/s, above the
    steady phase for the daemon, MongoDB-wire and the supervisor, after 15 s of settling),
    and the one after has every start-up behind it and the same servers, caches and
    collections as the steady phase."""
    data_dir = Path(tempfile.mkdtemp(prefix="rhizome-bench-steady-"))
    marker = str(data_dir)
    cli(data_dir, "up", "--embedded", "--grpc-port", "0", "--rest-port", "0")
    try:
        url = etcd_url(marker)
        # The platform's own start-up is not its idle cost. 5 s was not always enough
        # (session 11: an idle window of 0.10 CPU s/s against 0.05-0.07 in the other
        # rounds, every process raised): `--settle-s`.
        time.sleep(a.settle_s)
        first = Reading(marker, url, a.threads)
        time.sleep(a.idle_s)
        idle_end = Reading(marker, url, a.threads)
        idle = idle_end.since(first)
        code = data_dir / "code"
        shutil.copytree(GPT, code)
        args = [Path(x).name if x.startswith(str(code)) else x for x in entry(a, code)]
        manifest = (code / "manifest.yaml").read_text()
        manifest = re.sub(
            r"command: python train.py.*", f"command: python {' '.join(args)}", manifest
        )
        (code / "manifest.yaml").write_text(manifest)
        job_id = json.loads(cli(data_dir, "train", str(code / "manifest.yaml"), "--json"))["job_id"]
        out = data_dir / "jobs" / job_id / "learners" / "1" / "stdout.log"
        deadline = time.monotonic() + 900
        start: Reading | None = None
        while True:
            step = last_step(out)
            if start is None and step >= STEADY_FROM:
                start = Reading(marker, url, a.threads)
                first_step = step
            if start is not None and step >= a.steady - STEADY_TAIL:
                end = Reading(marker, url, a.threads)
                steady = end.since(start)
                if a.threads:  # named while they still run (py-spy dump: ~0.1 s each)
                    names = {pid: thread_names(pid) for pid, _ in end.cpu}
                break
            if time.monotonic() > deadline:
                sys.exit(f"platform job {job_id} did not reach step {a.steady - STEADY_TAIL}")
            time.sleep(0.25)
        steps_per_s = (step - first_step) / steady.seconds
        while True:
            job = json.loads(cli(data_dir, "show", job_id, "--json"))
            if job["status"] in ("COMPLETED", "FAILED", "HALTED", "DELETED"):
                break
            time.sleep(1)
        if job["status"] != "COMPLETED":
            sys.exit(f"platform job ended {job['status']}: {job['status_message']}")
        gone_by = time.monotonic() + 60
        while not job_processes_gone(marker) and time.monotonic() < gone_by:
            time.sleep(0.5)
        time.sleep(a.after_settle_s)  # the job's end (records, last logs indexed) is not idle
        after_first = Reading(marker, url, a.threads)
        time.sleep(a.idle_s)
        after_end = Reading(marker, url, a.threads)
        idle_after = after_end.since(after_first)
        if a.threads:
            for line in thread_lines((after_first, after_end), (start, end), names):
                print(line, flush=True)
    finally:
        cli(data_dir, "down")
        shutil.rmtree(data_dir, ignore_errors=True)
    return idle, idle_after, steady, steps_per_s


PLATFORM_KINDS = (
    "etcd",
    "daemon",
    "guardian",
    "controllers",
    "mongo-wire",
    "elasticsearch-api",
    "supervisor",
)


def cost_lines(label: str, before: Window, idle: Window, steady: Window, rate: float) -> list[str]:
    """A round's lines: per kind CPU s/s idle before the job, idle after it (the
    baseline), steady, and steady minus idle after (what the running job costs)."""
    b, i, s = before.per_s(), idle.per_s(), steady.per_s()
    kinds = [k for k in PLATFORM_KINDS if k in b or k in i or k in s]
    total_b = sum(b.get(k, 0.0) for k in kinds)
    total_i = sum(i.get(k, 0.0) for k in kinds)
    total_s = sum(s.get(k, 0.0) for k in kinds)
    lines = [
        f"  {label}: {rate:.2f} steps/s over {steady.seconds:.1f} s steady; platform CPU s/s "
        f"idle before {total_b:.3f}, idle after {total_i:.3f}, job steady {total_s:.3f}, "
        f"per second of job {total_s - total_i:.3f}"
        f" ({(total_s - total_i) / rate * 1000:.1f} ms a step; workers {s.get('workers', 0.0):.2f})"
    ]
    for k in kinds:
        lines.append(
            f"    {k:<18} idle {b.get(k, 0.0):.3f} / {i.get(k, 0.0):.3f}  "
            f"steady {s.get(k, 0.0):.3f}  job {s.get(k, 0.0) - i.get(k, 0.0):+.3f}"
        )
    ei, es = idle.etcd_per_s(), steady.etcd_per_s()
    top = sorted(es, key=lambda k: -es[k])
    lines.append(
        "    etcd msgs/s steady (idle): "
        + ", ".join(f"{k} {es[k]:.1f} ({ei.get(k, 0.0):.1f})" for k in top if es[k] >= 0.05)
    )
    return lines


def steady_cost(a: argparse.Namespace) -> None:
    tree = Path(a.tree).resolve() if a.tree else ROOT
    trees: list[tuple[str, Cli]] = [(f"{tree.name}", tree_cli(tree) if a.tree else rz)]
    for base in reversed([Path(t).resolve() for t in a.baseline_tree.split(",") if t]):
        trees.insert(0, (f"baseline {base.name}", tree_cli(base)))
    a.steps = a.steady
    totals: dict[str, list[float]] = {label: [] for label, _ in trees}
    for n in range(a.rounds):
        print(f"round {n + 1} (load {load()}):")
        order = trees if n % 2 == 0 else trees[::-1]  # each tree first and last in turn
        for label, cli in order:
            before, idle, steady, rate = steady_round(a, cli)
            for line in cost_lines(label, before, idle, steady, rate):
                print(line, flush=True)
            job = sum(steady.per_s().get(k, 0.0) - idle.per_s().get(k, 0.0) for k in PLATFORM_KINDS)
            totals[label].append(job)
    print(f"platform CPU s per second of job, {a.rounds} rounds, median (load now {load()}):")
    for label, values in totals.items():
        print(
            f"  {label}: {statistics.median(values):.3f} ({', '.join(f'{v:.3f}' for v in values)})"
        )


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def cpu_line(seconds: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in seconds.items() if v >= 0.05)


def failover_and_reconfiguration(
    a: argparse.Namespace, joiner: str = "--replace"
) -> dict[str, float]:
    """``joiner``: ``--replace`` (a replacement process is started after the loss: a
    cold start) or ``--standbys=1`` (a standby started with the job waits, warm)."""
    kill_at = 30
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "learner.runtime.launch",
            "--stages",
            "2",
            "--etcd",
            "auto",
            joiner,
            str(GPT / "train.py"),
            *script_args(a),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    events: list[tuple[float, str]] = []
    err_lines: list[str] = []

    def read_err() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            events.append((time.monotonic(), line))
            err_lines.append(line)

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    out_lines: list[str] = []
    arrivals: list[tuple[float, int, int]] = []  # (when the line came, step, generation)
    t_kill = None
    for line in proc.stdout:
        out_lines.append(line)
        got = STEP.match(line.strip())
        if got:
            arrivals.append((time.monotonic(), int(got.group(1)), int(got.group(2))))
        m = STEP.match(line.strip())
        if t_kill is None and m and int(m.group(1)) >= kill_at:
            pid = next(
                int(e[1].split()[-1])
                for e in events
                if e[1].startswith("rhizome-runtime: worker 1 pid")
            )
            os.kill(pid, signal.SIGKILL)
            t_kill = time.monotonic()
    proc.wait()
    reader.join(timeout=10)
    if proc.returncode != 0 or t_kill is None:
        sys.exit(f"failover run failed:\n{''.join(err_lines)[-3000:]}")
    # Wall-clock gaps between consecutive step lines as they arrive: the step lines come
    # from whichever worker holds the last stage (the survivor after the failover, the
    # replacement after the reconfiguration), whose own step timer would miss what the
    # others lost. A pause is the gap before the first line of a generation, less one
    # median gap, in iterations.
    gaps = [(b[0] - a[0], b[2]) for a, b in itertools.pairwise(arrivals)]
    median = statistics.median(g for g, _ in gaps[5:])

    def pause(generation: int) -> float:
        gap = next((g for g, gen in gaps if gen == generation), None)
        return float("nan") if gap is None else (gap - median) / median

    def seconds_to(pattern: str) -> float:
        hit = next((t for t, line in events if re.search(pattern, line) and t >= t_kill), None)
        return float("nan") if hit is None else hit - t_kill

    return {
        "median_step_s": median,
        "failover_pause_iterations": pause(1),
        "reconfiguration_pause_iterations": pause(2),
        "kill_to_failover_s": seconds_to(r"\[worker 0\] joined generation 1 "),
        "kill_to_redundancy_restored_s": seconds_to(
            r"\[worker 1\] joined generation 2 .*reconfiguration"
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument(
        "--standby-compare",
        action="store_true",
        help="only kill -> redundancy restored, with a replacement (cold start) and with a "
        "standby (pipeline.standbys: warm, waiting) in the same run",
    )
    p.add_argument("--rounds", type=int, default=5, help="interleaved bare/platform rounds")
    p.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="do not pin each worker to core (worker %% cores)",
    )
    p.add_argument(
        "--throughput-only", action="store_true", help="skip the failover/reconfiguration run"
    )
    p.add_argument(
        "--poll-show",
        action="store_true",
        help="watch the platform job with `rhizome show` every second while it trains (how "
        "this benchmark measured before: a CLI process a second on the same cores)",
    )
    p.add_argument(
        "--show-every",
        type=float,
        default=0.0,
        metavar="S",
        help="also read the platform job's status (`rhizome show`) every S seconds while it "
        "trains, as this benchmark did until session 10 (S = 10); default: not while it trains",
    )
    p.add_argument(
        "--steady",
        type=int,
        default=0,
        metavar="N",
        help="only the platform's CPU per second of a running job: an N-step job's steady "
        f"phase (steps {STEADY_FROM} to N-{STEADY_TAIL}) against the idle platform",
    )
    p.add_argument("--idle-s", type=float, default=10.0, help="with --steady: idle window")
    p.add_argument(
        "--settle-s",
        type=float,
        default=20.0,
        help="with --steady: seconds after `rhizome up` before the idle window (start-up "
        "is not idle cost; 5 until session 11)",
    )
    p.add_argument(
        "--after-settle-s",
        type=float,
        default=5.0,
        help="with --steady: seconds after the job's processes are gone before the idle "
        "window after the job (the baseline; its end is not idle cost)",
    )
    p.add_argument(
        "--threads",
        action="store_true",
        help="with --steady: also CPU s/s per thread of every platform process, idle and "
        "steady (named by `py-spy dump` when py-spy is installed next to this interpreter)",
    )
    p.add_argument(
        "--baseline-tree",
        default="",
        help="with --steady: also run the platform from this checkout (before/after); "
        "several, comma-separated, for a chain of commits",
    )
    p.add_argument(
        "--tree",
        default="",
        help="with --steady: run the platform from this checkout instead of this one (to "
        "compare two commits: each a `git archive` of it, plus gen/)",
    )
    a = p.parse_args()
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    if a.steady:
        if a.steady < STEADY_FROM + STEADY_TAIL + 10:
            p.error(f"--steady must be at least {STEADY_FROM + STEADY_TAIL + 10}")
        steady_cost(a)
        return
    if a.standby_compare:
        cold = failover_and_reconfiguration(a, "--replace")["kill_to_redundancy_restored_s"]
        warm = failover_and_reconfiguration(a, "--standbys=1")["kill_to_redundancy_restored_s"]
        print(f"kill -> redundancy restored, replacement started after the loss: {cold:.2f} s")
        print(f"kill -> redundancy restored, standby waiting: {warm:.2f} s")
        print(f"ratio replacement/standby: {cold / warm:.1f}x")
        return
    rounds = interleaved(a)
    ratios = [p_ / b for b, p_, _, _, _ in rounds]
    bares = [b for b, _, _, _, _ in rounds]
    pin = "each worker pinned to one core" if a.pin else "not pinned"
    watch = (
        "rhizome show every second"
        if a.poll_show
        else f"its files, rhizome show every {a.show_every:g} s"
        if a.show_every
        else "its files, its status read once they show it ended (no rhizome show while it trains)"
    )
    print(
        f"{a.rounds} interleaved rounds, 2 stages x 1 pipeline, {pin}; platform job watched by {watch}:"
    )
    for n, ((b, p_, bcpu, pcpu, at), r) in enumerate(zip(rounds, ratios, strict=True), 1):
        print(
            f"  round {n}: bare {b:.2f} steps/s, platform {p_:.2f} steps/s, ratio {r:.3f} "
            f"(load average {at})"
        )
        print(f"    CPU s, bare:     {cpu_line(bcpu)}")
        print(f"    CPU s, platform: {cpu_line(pcpu)}")
    print(
        f"ratio platform/bare: median {statistics.median(ratios):.3f}, range "
        f"{min(ratios):.3f}-{max(ratios):.3f} (goal >= 0.97); bare runs alone spread "
        f"{max(bares) / min(bares):.2f}x"
    )
    if a.throughput_only:
        return
    fr = failover_and_reconfiguration(a)
    print(f"median step: {fr['median_step_s'] * 1000:.1f} ms")
    print(
        f"failover pause: {fr['failover_pause_iterations']:.2f} iterations (goal < 1); "
        f"reconfiguration pause: {fr['reconfiguration_pause_iterations']:.2f} iterations "
        "(goal < 2)"
    )
    print(
        f"kill -> survivors in the new generation: {fr['kill_to_failover_s']:.2f} s; "
        f"kill -> redundancy restored (replacement joined): "
        f"{fr['kill_to_redundancy_restored_s']:.2f} s"
    )


if __name__ == "__main__":
    main()
