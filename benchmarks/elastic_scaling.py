"""Elastic scaling (issue #19, Amoeba): the stall of a scale-out (2 -> 4 workers) and a
scale-in (4 -> 2) against stop-resume of the same job, and the throughput of a job that
uses transient idle workers (Amoeba Fig. 8 shape), in one run. Every part runs
examples/elastic-regression/train.py (a linear model, gloo, batch 8 per worker) on real
etcd and real worker processes.

Stall = the wall time between the last step before the change and the first step after
it, minus one ordinary step (the median step interval before the change); in
iterations = stall / that median. Step times are the workers' own logged step
timestamps (`sample_log`: the earliest worker to log a committed step). The joiners'
preparation (process start, imports, model and data) is not stall for elastic scaling
(the others train meanwhile); for stop-resume it is. Amoeba: scale-out ~1.1 s, scale-in
no noticeable stall, stop-resume tens of seconds. Goal: scale-out < 0.5 s and
<= 1 iteration.

Parts (any combination; none given: --bare):

--bare       bare processes: 2 workers, 2 more join, those 2 are SIGTERMed; stop-resume =
             both save on SIGTERM and exit, 4 fresh processes load the checkpoint.
--platform   the same through the embedded platform (`rhizome up --embedded`, the local
             backend): the example submitted with `rhizome train` (learners: 2,
             `elastic: {min: 2, max: 4}`), `rhizome scale JOB 4`, `rhizome scale JOB 2`;
             stop-resume = `rhizome halt JOB` (the learners save the example's checkpoint,
             `--checkpoint` in $RHIZOME_CHECKPOINT_DIR, on the SIGTERM), `rhizome scale
             JOB 4` of the halted job and `rhizome resume JOB`: stall = last step before
             the halt -> first step after the resume.
--transient  Amoeba Fig. 8 shape, bare processes: a job on 2 base workers trains for
             --span seconds; every --period seconds 2 idle workers are available for W
             seconds (one row per W in --windows). Samples trained over the span for:
             baseline (2 workers, never scaled), stop-resume (every worker saves and
             exits, the job restarts at the new size at each window's start and end),
             elastic (the 2 extras join and are SIGTERMed, leaving at a mini-batch
             boundary), ideal (computed: the baseline's rate, times the measured speedup
             of 4 vs 2 workers while extras are available: an instant, free resize).
             The extras' processes start when their window opens (cold: imports, model,
             data), as a freshly available machine would; with --warm also with every
             new process started ahead (imported, a model and optimizer built once).

Step compute is the example's fixed --step-delay (a sleep), so 4 workers on a 2-core
machine measure the runtime, not CPU contention. Stops processes by pid only.

    .venv/bin/python benchmarks/elastic_scaling.py [--bare] [--platform] [--transient]
        [--warm] [--step-delay 0.05] [--span 80 --period 40 --windows 5,10,30]
"""

from __future__ import annotations

import argparse
import importlib.util
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
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from services.embedded.servers import EtcdServer  # noqa: E402

EXAMPLE = ROOT / "examples" / "elastic-regression"
BATCH = 8
# a stop-resume is "slower than baseline" (Amoeba) for windows up to this long
SHORT_WINDOW_S = 10.0
ELASTIC_GOAL = 0.97

Record = dict[str, Any]


# -- arithmetic (tests/test_bench_elastic.py checks it on synthetic step logs) ---------


def committed(records: Iterable[Record]) -> list[Record]:
    """One record per committed step (the earliest worker's), in step order. A step's
    record lists each worker's samples; redone-step records carry no `samples`."""
    out: dict[int, Record] = {}
    for rec in records:
        if "samples" in rec and (rec["step"] not in out or rec["time"] < out[rec["step"]]["time"]):
            out[rec["step"]] = rec
    return [out[s] for s in sorted(out)]


def step_times(records: Iterable[Record]) -> dict[int, float]:
    """step -> the earliest time a worker logged it committed."""
    return {r["step"]: r["time"] for r in committed(records)}


def width(rec: Record) -> int:
    """How many workers trained the step (those with samples in it)."""
    return sum(1 for ids in rec["samples"].values() if ids)


def n_samples(rec: Record) -> int:
    return sum(len(ids) for ids in rec["samples"].values())


def stall(
    times: dict[int, float], last_before: int, first_after: int | None = None
) -> tuple[float, float]:
    """(seconds, iterations) lost between step `last_before` and `first_after` (default:
    the next step): the time between them minus as many ordinary steps (the median of
    the up to 9 step intervals before `last_before`). A scale-out whose two joiners
    arrive one after the other re-forms twice (2 -> 3 -> 4): both re-forms count, the
    steps on 3 between them as ordinary steps."""
    first_after = last_before + 1 if first_after is None else first_after
    steps = sorted(s for s in times if s <= last_before)[-10:]
    median = statistics.median(times[b] - times[a] for a, b in itertools.pairwise(steps))
    gap = times[first_after] - times[last_before] - (first_after - last_before) * median
    return gap, gap / median


def around_change(records: Iterable[Record], requested_at: int, n: int) -> tuple[int, int, int]:
    """A resize to `n` workers asked while step `requested_at` was the newest: (the last
    step of the generation then current, the first step on `n` workers after it, how
    many re-forms happened between them). Widths alone mislead at an epoch's end, where
    some workers get no samples."""
    steps = [r for r in committed(records) if r["step"] >= requested_at]
    # the generation's steps from the request on (a later restart of the job, e.g. a
    # halt and resume, numbers its generations from 1 again)
    g0 = steps[0]["generation"]
    last_before = next(
        (a["step"] for a, b in itertools.pairwise(steps) if b["generation"] != g0),
        steps[-1]["step"],
    )
    after = [r for r in steps if r["step"] > last_before]
    first_after = next(r["step"] for r in after if width(r) == n)
    reforms = len({r["generation"] for r in after if r["step"] <= first_after})
    return last_before, first_after, reforms


def stall_of_change(
    records: Iterable[Record], requested_at: int, n: int
) -> tuple[float, float, int]:
    """(seconds, iterations, re-forms) of a resize to `n` asked at step `requested_at`."""
    recs = list(records)
    last_before, first_after, reforms = around_change(recs, requested_at, n)
    return (*stall(step_times(recs), last_before, first_after), reforms)


def first_step_of_width(records: Iterable[Record], n: int, after: int = -1) -> int | None:
    return next(
        (r["step"] for r in committed(records) if r["step"] > after and width(r) == n), None
    )


def windows(span: float, period: float, length: float) -> list[tuple[float, float]]:
    """When extra workers are available, as (start, end) seconds into the span: one
    window of `length` centred in each `period`, whole periods only."""
    if not 0 < length < period:
        raise ValueError(f"a window of {length} s must be shorter than its period {period} s")
    return [
        (k * period + (period - length) / 2, k * period + (period + length) / 2)
        for k in range(int(span // period))
    ]


def samples_in(records: Iterable[Record], start: float, end: float) -> int:
    """Samples of the steps committed in [start, end)."""
    return sum(n_samples(r) for r in committed(records) if start <= r["time"] < end)


def sample_rates(runs: Iterable[Iterable[Record]]) -> dict[int, float]:
    """Steady samples/s by width over several runs: the median samples per step over the
    median interval between consecutive steps of that width in the same job and
    generation (re-forms and restarts are left out: those are what the ideal leaves
    out). Runs are kept apart: their step numbers overlap."""
    gaps: dict[int, list[float]] = {}
    sizes: dict[int, list[int]] = {}
    for records in runs:
        for a, b in itertools.pairwise(committed(records)):
            if (
                b["step"] == a["step"] + 1
                and (a.get("job"), a.get("generation")) == (b.get("job"), b.get("generation"))
                and width(a) == width(b)
            ):
                gaps.setdefault(width(b), []).append(b["time"] - a["time"])
                sizes.setdefault(width(b), []).append(n_samples(b))
    return {n: statistics.median(sizes[n]) / statistics.median(g) for n, g in gaps.items()}


def ideal_samples(
    baseline: float, span: float, available: Sequence[tuple[float, float]], speedup: float
) -> float:
    """The baseline's samples over `span` if every window were an instant, free resize:
    the baseline rate outside the windows, `speedup` times it inside."""
    extra_s = sum(e - s for s, e in available)
    return baseline / span * ((span - extra_s) + speedup * extra_s)


@dataclass
class Row:
    window_s: float
    baseline: int
    stop_resume: int
    elastic: int
    ideal: float

    @property
    def elastic_vs_ideal(self) -> float:
        return self.elastic / self.ideal

    @property
    def stop_resume_vs_baseline(self) -> float:
        return self.stop_resume / self.baseline

    def verdicts(self) -> str:
        el = "yes" if self.elastic_vs_ideal >= ELASTIC_GOAL else "no"
        out = f"elastic >= {ELASTIC_GOAL} x ideal: {el}"
        if self.window_s <= SHORT_WINDOW_S:
            sr = "yes" if self.stop_resume < self.baseline else "no"
            out += f"; stop-resume < baseline (short window): {sr}"
        return out


def table(rows: Sequence[Row]) -> list[str]:
    lines = [
        "W (s) | baseline | stop-resume | elastic | ideal | elastic/ideal | stop-resume/baseline"
    ]
    for r in rows:
        lines.append(
            f"{r.window_s:5g} | {r.baseline:8d} | {r.stop_resume:11d} | {r.elastic:7d} | "
            f"{r.ideal:7.0f} | {r.elastic_vs_ideal:13.3f} | {r.stop_resume_vs_baseline:20.3f}"
            f"   {r.verdicts()}"
        )
    return lines


def read_logs(paths: Iterable[Path]) -> list[Record]:
    out: list[Record] = []
    for path in paths:
        # a line being written as we read is skipped: the next read has it whole
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


# -- bare processes ----------------------------------------------------------------------


class Run:
    """Worker processes of one elastic job on a private etcd; every worker logs its
    committed steps to `tmp/log-<worker>.jsonl`."""

    def __init__(self, etcd: str, tmp: Path, job: str, step_delay: float) -> None:
        self.etcd, self.tmp, self.job, self.step_delay = etcd, tmp, job, step_delay
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.jobs: dict[str, str] = {}  # worker -> the job id it ran in

    def start(self, worker: str, *extra: str, trigger: Path | None = None) -> None:
        """Start `worker`; with `trigger`, started ahead: it waits for that file to exist
        (imports done) before it builds its model and joins."""
        head = [sys.executable, str(EXAMPLE / "train.py")]
        if trigger is not None:
            head = [sys.executable, str(Path(__file__).resolve()), "--warm-worker", str(trigger)]
        argv = [
            *head, "--job", self.job, "--etcd", self.etcd,
            "--worker", worker, "--epochs", "1000", "--samples", "4096",
            "--batch-size", str(BATCH), "--step-delay", str(self.step_delay),
            "--sample-log", str(self.tmp / f"log-{worker}.jsonl"), *extra,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        out = (self.tmp / f"{self.job}-{worker}.out").open("wb")
        self.procs[worker] = subprocess.Popen(
            argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env
        )
        self.jobs[worker] = self.job

    def records(self) -> list[Record]:
        """Every worker's log lines, each with the job id it ran in (`job`)."""
        recs = read_logs(self.tmp.glob("log-*.jsonl"))
        return [{**r, "job": self.jobs.get(r.get("worker", ""), self.job)} for r in recs]

    def times(self) -> dict[int, float]:
        return step_times(self.records())

    def wait_steps(self, n: int, timeout: float = 300) -> int:
        deadline = time.monotonic() + timeout
        while (steps := max(self.times(), default=-1) + 1) < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for step {n} of {self.job}; see {self.tmp}")
            time.sleep(0.05)
        return steps

    def signal(self, *workers: str) -> None:
        for w in workers:
            if self.procs[w].poll() is None:
                os.kill(self.procs[w].pid, signal.SIGTERM)

    def reap(self, *workers: str, timeout: float = 60) -> None:
        """Wait for `workers` to exit; SIGKILL (by pid) any still there after `timeout`
        (e.g. a joiner SIGTERMed while it waited for peers that already left)."""
        deadline = time.monotonic() + timeout
        for w in workers:
            try:
                self.procs[w].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.kill(self.procs[w].pid, signal.SIGKILL)
                self.procs[w].wait(10)

    def terminate(self, *workers: str) -> None:
        self.signal(*workers)
        self.reap(*workers)

    def alive(self) -> list[str]:
        return [w for w, p in self.procs.items() if p.poll() is None]


def bare_stalls(etcd: str, tmp: Path, step_delay: float) -> None:
    el = Run(etcd, tmp / "elastic", "elastic", step_delay)
    el.tmp.mkdir()
    for w in ("w0", "w1"):
        el.start(w, "--min-workers", "2")
    el.wait_steps(20)
    asked_out = max(el.times())
    for w in ("w2", "w3"):
        el.start(w)
    while (first_four := first_step_of_width(el.records(), 4, after=asked_out)) is None:
        time.sleep(0.05)
    el.wait_steps(first_four + 20)
    asked_in = max(el.times())
    el.terminate("w2", "w3")
    while (first_two := first_step_of_width(el.records(), 2, after=asked_in)) is None:
        time.sleep(0.05)
    el.wait_steps(first_two + 12)
    el.terminate("w0", "w1")
    records = el.records()
    out_s, out_it, out_re = stall_of_change(records, asked_out, 4)
    in_s, in_it, in_re = stall_of_change(records, asked_in, 2)

    sr = Run(etcd, tmp / "stop-resume", "stop-resume", step_delay)
    sr.tmp.mkdir()
    ckpt = sr.tmp / "ckpt.pt"
    for w in ("w0", "w1"):
        sr.start(w, "--min-workers", "2", "--checkpoint", str(ckpt))
    sr.wait_steps(20)
    sr.terminate("w0", "w1")  # both save on leaving (the later one wins: same state)
    last = max(sr.times())
    sr2 = Run(etcd, sr.tmp, "stop-resume-2", step_delay)
    for w in ("r0", "r1", "r2", "r3"):
        sr2.start(w, "--min-workers", "4", "--checkpoint", str(ckpt))
    sr2.wait_steps(last + 12)
    sr2.terminate("r0", "r1", "r2", "r3")
    sr_s, sr_it = stall(sr2.times(), last)

    print("== bare processes (private etcd, no platform)")
    print(f"step compute {step_delay:.3f} s (sleep); shared 2-core machine")
    print(
        f"elastic scale-out 2->4 stall: {out_s:.3f} s = {out_it:.2f} iterations ({out_re} re-forms)"
    )
    print(f"elastic scale-in  4->2 stall: {in_s:.3f} s = {in_it:.2f} iterations ({in_re} re-forms)")
    print(f"stop-resume 2->4 stall:       {sr_s:.3f} s = {sr_it:.2f} iterations")
    print(f"stop-resume / elastic scale-out: {sr_s / max(out_s, 1e-3):.1f}x", flush=True)


# -- through the platform ----------------------------------------------------------------


def platform_stalls(step_delay: float) -> None:
    from _platform import EmbeddedUp

    with EmbeddedUp() as rz:
        code = rz.data_dir / "code-elastic"
        shutil.copytree(EXAMPLE, code)
        manifest = (code / "manifest.yml").read_text()
        manifest = re.sub(r"elastic: \{.*\}", "elastic: {min: 2, max: 4}", manifest)
        # the step log and the checkpoint live in the job's checkpoint directory, which
        # halt and resume keep (the result directories are per learner run)
        command = (
            f"command: python train.py --epochs 1000 --samples 4096 --batch-size {BATCH} "
            f"--min-workers 2 --step-delay {step_delay} "
            '--sample-log "$RHIZOME_CHECKPOINT_DIR/steps-$RHIZOME_RANK.jsonl" '
            '--checkpoint "$RHIZOME_CHECKPOINT_DIR/state.pt"'
        )
        manifest = re.sub(r"command: python train.py.*", command, manifest)
        (code / "manifest.yml").write_text(manifest)
        job = json.loads(rz("train", str(code / "manifest.yml"), "--json"))["job_id"]
        ckpt_dir = rz.data_dir / "jobs" / job / "checkpoints"

        def records() -> list[Record]:
            return read_logs(ckpt_dir.glob("steps-*.jsonl"))

        def wait_for(what: str, cond: Any, timeout: float = 300) -> Any:
            deadline = time.monotonic() + timeout
            while not (got := cond()):
                if time.monotonic() > deadline:
                    sys.exit(f"{what}: not reached; {rz('show', job)}")
                time.sleep(0.1)
            return got

        def steps() -> int:
            return max((r["step"] for r in committed(records())), default=-1) + 1

        wait_for("20 steps on 2 learners", lambda: steps() >= 20, timeout=600)
        asked_out = steps() - 1
        t = time.monotonic()
        rz("scale", job, "4", "--timeout", "300")
        scale_out_cmd = time.monotonic() - t
        first_four = wait_for(
            "a step on 4", lambda: first_step_of_width(records(), 4, after=asked_out)
        )
        wait_for("20 steps on 4", lambda: steps() >= first_four + 20)
        asked_in = steps() - 1
        t = time.monotonic()
        rz("scale", job, "2", "--timeout", "300")
        scale_in_cmd = time.monotonic() - t
        first_two = wait_for(
            "a step on 2 again", lambda: first_step_of_width(records(), 2, after=asked_in)
        )
        wait_for("12 steps on 2", lambda: steps() >= first_two + 12)

        t = time.monotonic()
        rz("halt", job, "--timeout", "300")
        halt_cmd = time.monotonic() - t
        status = json.loads(rz("show", job, "--json"))["status"]
        saved = (ckpt_dir / "state.pt").exists()
        last = steps() - 1
        rz("scale", job, "4")  # a halted job: the size it resumes with
        t = time.monotonic()
        rz("resume", job, "--timeout", "300")
        wait_for("12 steps after the resume", lambda: steps() >= last + 12, timeout=600)
        resume_to_steps = time.monotonic() - t
        times = step_times(records())
        after = committed(records())
        resumed_width = next(width(r) for r in after if r["step"] == last + 1)
        rz("delete", job, "--timeout", "120")

    out_s, out_it, out_re = stall_of_change(after, asked_out, 4)
    in_s, in_it, in_re = stall_of_change(after, asked_in, 2)
    sr_s, sr_it = stall(times, last)
    print("== through the platform (rhizome up --embedded, local backend, CLI)")
    print(f"step compute {step_delay:.3f} s (sleep); shared 2-core machine")
    print(
        f"rhizome scale 4 returned after {scale_out_cmd:.2f} s, scale 2 after "
        f"{scale_in_cmd:.2f} s; halt after {halt_cmd:.2f} s ({status}, checkpoint saved: "
        f"{'yes' if saved else 'NO'}); resume -> 12 steps {resume_to_steps:.2f} s"
    )
    print(
        f"elastic scale-out 2->4 stall: {out_s:.3f} s = {out_it:.2f} iterations ({out_re} re-forms)"
    )
    print(f"elastic scale-in  4->2 stall: {in_s:.3f} s = {in_it:.2f} iterations ({in_re} re-forms)")
    print(
        f"stop-resume (halt, resume at 4) stall: {sr_s:.3f} s = {sr_it:.2f} iterations "
        f"(first step after it on {resumed_width} workers)"
    )
    print(f"stop-resume / elastic scale-out: {sr_s / max(out_s, 1e-3):.1f}x", flush=True)


# -- transient idle workers (Amoeba Fig. 8 shape) ----------------------------------------


class Transient:
    """One run per configuration, each on its own job ids. `warm`: every worker process
    that a resize needs is started ahead (at the previous resize, or before the span),
    imports torch and the elastic worker, builds a throwaway model and optimizer (torch's
    first optimizer imports more of torch) and waits for its trigger file
    (`--warm-worker`): what a resize then costs is the runtime's part, not a Python
    process's start."""

    def __init__(self, etcd: str, tmp: Path, step_delay: float, span: float) -> None:
        self.etcd, self.tmp, self.step_delay, self.span = etcd, tmp, step_delay, span
        self.n = 0

    def _run(self, name: str) -> Run:
        self.n += 1
        run = Run(self.etcd, self.tmp / f"{self.n}-{name}", f"t{self.n}-{name}", self.step_delay)
        run.tmp.mkdir(parents=True)
        return run

    @staticmethod
    def _first_step(run: Run) -> float:
        deadline = time.monotonic() + 300
        while not (times := run.times()):
            if time.monotonic() > deadline:
                raise SystemExit(f"{run.job}: no step in 300 s; see {run.tmp}")
            time.sleep(0.02)
        return min(times.values())

    @staticmethod
    def _until(t: float) -> None:
        time.sleep(max(0.0, t - time.time()))

    def _count(self, run: Run, t0: float) -> list[Record]:
        self._until(t0 + self.span + 0.5)  # a step committed at the end is logged by then
        run.terminate(*run.alive())
        return run.records()

    def baseline(self) -> tuple[int, list[Record]]:
        run = self._run("baseline")
        for w in ("b0", "b1"):
            run.start(w, "--min-workers", "2")
        t0 = self._first_step(run)
        recs = self._count(run, t0)
        return samples_in(recs, t0, t0 + self.span), recs

    def elastic(self, wins: Sequence[tuple[float, float]], warm: bool) -> tuple[int, list[Record]]:
        run = self._run("elastic-warm" if warm else "elastic")

        def extras(k: int) -> tuple[str, str]:
            names = (f"x{k}a", f"x{k}b")
            for w in names:
                run.start(w, trigger=run.tmp / f"go-{k}" if warm else None)
            return names

        for w in ("b0", "b1"):
            run.start(w, "--min-workers", "2")
        ready = extras(0) if warm and wins else ()
        t0 = self._first_step(run)
        for k, (s, e) in enumerate(wins):
            self._until(t0 + s)
            if warm:
                (run.tmp / f"go-{k}").touch()
                now = ready
            else:
                now = extras(k)
            self._until(t0 + e)
            run.signal(*now)  # they leave at the end of a mini-batch; reaped at the end
            if warm and k + 1 < len(wins):
                ready = extras(k + 1)
        recs = self._count(run, t0)
        return samples_in(recs, t0, t0 + self.span), recs

    def stop_resume(
        self, wins: Sequence[tuple[float, float]], warm: bool
    ) -> tuple[int, list[Record]]:
        """Every resize is: SIGTERM every worker (each saves the checkpoint on leaving),
        wait for them to exit, start the new size from the checkpoint (a new job id:
        a fresh rendezvous, as a restarted job gets)."""
        run = self._run("stop-resume-warm" if warm else "stop-resume")
        ckpt = run.tmp / "ckpt.pt"
        gen = 0
        current: list[str] = []
        ready: list[str] = []

        def launch(size: int) -> list[str]:
            nonlocal gen
            gen += 1
            run.job = f"t{self.n}-stop-resume-{gen}"
            trigger = run.tmp / f"go-{gen}" if warm else None
            names = [f"g{gen}w{i}" for i in range(size)]
            for w in names:
                run.start(w, "--min-workers", str(size), "--checkpoint", str(ckpt), trigger=trigger)
            return names

        def resize(size: int) -> None:
            nonlocal current, ready
            run.terminate(*current)
            if warm:
                (run.tmp / f"go-{gen}").touch()  # the set started ahead loads the checkpoint
                current = ready
                ready = launch(2 if size == 4 else 4)
            else:
                current = launch(size)

        current = launch(2)
        if warm:
            (run.tmp / f"go-{gen}").touch()
            ready = launch(4)
        t0 = self._first_step(run)
        for s, e in wins:
            self._until(t0 + s)
            resize(4)
            self._until(t0 + e)
            resize(2)
        recs = self._count(run, t0)
        return samples_in(recs, t0, t0 + self.span), recs


def join_delays(
    records: Iterable[Record], t0: float, wins: Sequence[tuple[float, float]]
) -> list[float | None]:
    """Per window: seconds from its opening to the first step on 4 workers within it
    (None: the extras never trained together in it)."""
    steps = committed(records)
    out: list[float | None] = []
    for s, e in wins:
        first = next(
            (r["time"] for r in steps if t0 + s <= r["time"] < t0 + e and width(r) == 4), None
        )
        out.append(None if first is None else first - (t0 + s))
    return out


def transient(
    etcd: str,
    tmp: Path,
    step_delay: float,
    span: float,
    period: float,
    lengths: Sequence[float],
    warm: bool,
) -> None:
    tr = Transient(etcd, tmp / "transient", step_delay, span)
    base, base_recs = tr.baseline()
    runs = [base_recs]
    cold: list[tuple[float, int, int, list[tuple[float, float]]]] = []
    warmed: list[tuple[float, int, int, list[tuple[float, float]]]] = []
    delays: list[str] = []
    for length in lengths:
        wins = windows(span, period, length)
        for variant, out in ((False, cold), (True, warmed)) if warm else ((False, cold),):
            sr, sr_recs = tr.stop_resume(wins, variant)
            el, el_recs = tr.elastic(wins, variant)
            out.append((length, sr, el, wins))
            runs += [el_recs, sr_recs]
            t0 = min(step_times(el_recs).values())
            joins = ", ".join(
                "never" if d is None else f"{d:.1f} s" for d in join_delays(el_recs, t0, wins)
            )
            label = "warm" if variant else "cold"
            delays.append(f"  W={length:g} s, {label}: window open -> first step on 4: {joins}")
            print(f"  W={length:g} s {label} done: stop-resume {sr}, elastic {el}", file=sys.stderr)
    rates = sample_rates(runs)
    if 2 not in rates or 4 not in rates:
        raise SystemExit(f"no steady 2- and 4-worker steps to measure the speedup: {rates}")
    speedup = rates[4] / rates[2]
    print("== transient idle workers (Amoeba Fig. 8 shape): bare processes, private etcd")
    print(
        f"span {span:g} s; 2 base workers; 2 extra workers for W s centred in every "
        f"{period:g} s; step compute {step_delay:.3f} s (sleep: 4 workers on 2 cores "
        "measure the runtime, not CPU contention); samples trained over the span"
    )
    print(
        f"measured steady rates (every run of this part): 2 workers {rates[2]:.1f} "
        f"samples/s, 4 workers {rates[4]:.1f} samples/s: speedup {speedup:.3f}; ideal = "
        "baseline rate x (span - A + speedup x A), A = seconds extras are available"
    )
    for label, got in (("cold", cold), ("warm", warmed)):
        if not got:
            continue
        how = (
            "every new process starts when its resize happens (imports, model, data)"
            if label == "cold"
            else "every new process is started ahead and waits, imported, for its resize"
        )
        print(f"-- {label}: {how}")
        rows = [
            Row(length, base, sr, el, ideal_samples(base, span, wins, speedup))
            for length, sr, el, wins in got
        ]
        for line in table(rows):
            print(line)
    print("elastic joins (the elastic runs):")
    for line in delays:
        print(line)
    sys.stdout.flush()


def warm_worker(trigger: Path, argv: list[str]) -> int:
    """`--warm-worker TRIGGER ARGS`: import the example (torch, the elastic library),
    wait until TRIGGER exists, then run it with ARGS: a worker prepared ahead."""
    spec = importlib.util.spec_from_file_location("elastic_regression_train", EXAMPLE / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # `elastic.join` imports the worker (torch.distributed, the etcd client) only when
    # called, and torch's first optimizer imports more of torch (1.8 s measured on this
    # machine): a worker prepared ahead has both behind it
    importlib.import_module("learner.elastic.worker")
    module.make_optimizer(module.make_model())
    while not trigger.exists():
        time.sleep(0.01)
    return int(module.main(argv))


def main() -> None:
    if sys.argv[1:2] == ["--warm-worker"]:
        sys.exit(warm_worker(Path(sys.argv[2]), sys.argv[3:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bare", action="store_true", help="stalls with bare processes")
    parser.add_argument("--platform", action="store_true", help="stalls through the platform")
    parser.add_argument("--transient", action="store_true", help="Amoeba Fig. 8 throughput")
    parser.add_argument("--step-delay", type=float, default=0.05, help="compute seconds per step")
    parser.add_argument("--span", type=float, default=80.0, help="transient: seconds trained")
    parser.add_argument("--period", type=float, default=40.0, help="transient: window period")
    parser.add_argument(
        "--windows", default="5,10,30", help="transient: window lengths W in seconds"
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="transient: also with every new process started ahead (imports done)",
    )
    args = parser.parse_args()
    if not (args.bare or args.platform or args.transient):
        args.bare = True
    lengths = [float(x) for x in args.windows.split(",")]
    for length in lengths:
        windows(args.span, args.period, length)  # a bad window is refused before any run
    print(f"elastic_scaling.py {' '.join(sys.argv[1:])}; {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    tmp = Path(tempfile.mkdtemp(prefix="elastic-bench-"))
    if args.platform:
        platform_stalls(args.step_delay)
    if args.bare or args.transient:
        etcd = EtcdServer(tmp / "etcd")
        etcd.start()
        try:
            if args.bare:
                bare_stalls(etcd.url, tmp, args.step_delay)
            if args.transient:
                transient(
                    etcd.url, tmp, args.step_delay, args.span, args.period, lengths, args.warm
                )
        finally:
            etcd.stop()


if __name__ == "__main__":
    main()
