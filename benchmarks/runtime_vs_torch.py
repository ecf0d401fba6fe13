"""The pipeline runtime against torch.distributed.pipelining, in the same processes (issue #24).

    .venv/bin/python benchmarks/runtime_vs_torch.py [--steps 40] [--reps 3] [--profile] [--json]

Two stages (``--stages``) on CPU, gloo, one torch thread per process (``--backend nccl``:
stage s on GPU s, one GPU per stage; each step's end waits for the GPU), launched by
``learner.runtime.launch`` with this script as the training script. Inside the same worker
processes, one after the other, modes interleaved and repeated (``--reps``):

- ``torch-1f1b`` / ``torch-gpipe``: ``torch.distributed.pipelining`` ``PipelineStage`` with
  ``Schedule1F1B`` / ``ScheduleGPipe``, then the optimizer step;
- ``rz-none`` / ``rz-lazy-frc-lazy-brc`` / ``rz-eager-frc-lazy-brc``: the Rhizome runtime
  (``learner.runtime.engine.Worker``) in that redundancy mode, 1F1B order.

All of them train the same model (the char GPT of examples/pipeline-gpt: embedding + 4
pre-norm blocks of width 128, context 64) split where the runtime's ``balance="params"``
splits it, from the same seed, on the same 4 microbatches of 8 sequences per step, with
AdamW. Prints, per mode: the last stage's iteration time (median of the per-repetition
medians, and the best repetition), the ratios to torch 1F1B and to Rhizome none (same run),
the largest per-step loss difference to torch 1F1B, the CPU of each worker (fraction of
one core, steps 3+), and for eager FRC the share of its time that ran inside bubbles.

etcd's CPU, two ways: ``etcd CPU (steps 3+)``, the figure of the earlier sessions (its
threads' ``schedstat``, interpolated between 50 ms samples, from the end of step 2 to the
end of each run's last step), and ``etcd steady (steps k+)``, issue #24's goal: ``utime + stime`` of
the etcd process (``/proc/<pid>/stat``, every thread's, exited ones too; 10 ms ticks)
from the end of step k-1 (``--steady-from``, default a quarter of the steps) to the end
of the last-but-one step, so neither the run's start-up (leases, watches, rendezvous,
the first steps) nor its finish (``done/`` keys) is inside, summed over the
repetitions. Its baseline is etcd's own CPU with no job at all (``--idle-s`` seconds
before the first run and after the last). ``--json`` prints one JSON object instead:
``{"modes": {"torch-1f1b": {"iter_ms": ...}, ...}, "losses_match": true|false, ...}``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _pipeline_models import issue24_gpt_job  # noqa: E402

from learner.runtime.api import PipelineJob  # noqa: E402

TORCH_MODES = {"torch-1f1b": "1f1b", "torch-gpipe": "gpipe"}
RZ_MODES = {
    "rz-none": "none",
    "rz-lazy-frc-lazy-brc": "lazy-frc-lazy-brc",
    "rz-eager-frc-lazy-brc": "eager-frc-lazy-brc",
}
# Not run by default: eager FRC with every planned wait of schedule.frc_plan filled with
# exactly its planned FRC (Interpreter.cap_to_plan), against the default (the bubble
# predictor, the last stage's fill floor from the plan), measured interleaved in one run:
# the machine is too noisy for two runs to compare.
PLAN_CAPPED = "rz-eager-plan-capped"
# Not run by default either: the before of session 13's before/after pairs, in the same
# run — each owned block's pre-update snapshot taken in the sync phase, as before session
# 13, instead of in the step's first wait (Worker.snapshot_ahead; with eager FRC the
# snapshot stays in the sync phase anyway: measured slower ahead)
SNAPSHOT_INLINE = {
    "rz-none-snapshot-inline": "none",
    "rz-lazy-snapshot-inline": "lazy-frc-lazy-brc",
}
EXTRA_MODES = {PLAN_CAPPED: "eager-frc-lazy-brc", **SNAPSHOT_INLINE}
RZ_MODES_ALL = {**RZ_MODES, **EXTRA_MODES}
ALL_MODES = [*TORCH_MODES, *RZ_MODES]
WARM = 3  # steps dropped at the start of every run (allocator, bubble history)
DEFAULT_STEPS = 40  # per run: the steady etcd window needs seconds (10 ms CPU ticks)
PROFILE_STEPS = 12  # columns of --profile's per-step FRC table
IDLE_SETTLE_S = 2.0  # before an idle window: etcd's start (or the last run's end) settles
CLK_TCK = os.sysconf("SC_CLK_TCK")
LOSS_TOL = 1e-4
# issue #24's goals, each a ratio measured in the same run
GOALS = {
    "rz-none": ("torch-1f1b", 1.02),
    "rz-lazy-frc-lazy-brc": ("rz-none", 1.03),
    "rz-eager-frc-lazy-brc": ("rz-none", 1.10),
}
ETCD_GOAL = 0.01  # of one core, steady state


def tiny_job(steps: int, redundancy: str) -> PipelineJob:
    """The runtime tests' float64 MLP: the losses must match to rounding, not just 1e-4."""
    from learner.runtime.toy import toy_job

    return toy_job(steps=steps, microbatches=4, redundancy=redundancy, depth=4)


def gpt_job(steps: int, redundancy: str) -> PipelineJob:
    return issue24_gpt_job(steps, redundancy)


MODELS = {"gpt": gpt_job, "tiny": tiny_job}


# ----------------------------------------------------------------- worker side


class StepProbe:
    """Per step of one run: the garbage collector's pauses and the process's page faults and
    context switches (``--profile``), what tells a step slowed by the interpreter or the
    allocator from one slowed by the schedule.

    ``mark()`` at each step's end takes ``getrusage`` (the whole process: every thread);
    the collector's pauses come from ``gc.callbacks`` (whichever thread ran it) and go to
    the step in which they started.
    """

    def __init__(self) -> None:
        self.marks: list[tuple[float, int, int, int]] = []
        self.gc_events: list[tuple[float, float, int]] = []  # (start, seconds, generation)
        self._gc_start = 0.0
        self.marks.append(self._now())
        gc.callbacks.append(self._on_gc)

    @staticmethod
    def _now() -> tuple[float, int, int, int]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return (time.monotonic(), ru.ru_minflt, ru.ru_nvcsw, ru.ru_nivcsw)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.monotonic()
        else:
            start = self._gc_start
            self.gc_events.append((start, time.monotonic() - start, info["generation"]))

    def mark(self) -> None:
        self.marks.append(self._now())

    def close(self) -> dict[str, Any]:
        """Per step: [gc seconds, gen-2 collections, minor faults, voluntary and involuntary
        context switches]."""
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)
        rows: list[list[float]] = []
        for a, b in itertools.pairwise(self.marks):
            pauses = [e for e in self.gc_events if a[0] <= e[0] < b[0]]
            rows.append(
                [
                    sum(e[1] for e in pauses),
                    float(sum(1 for e in pauses if e[2] == 2)),
                    float(b[1] - a[1]),
                    float(b[2] - a[2]),
                    float(b[3] - a[3]),
                ]
            )
        # the process's OS threads at the run's end (kept pools, gloo's and gRPC's
        # threads: the ones left behind by earlier runs share the worker's core too)
        threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0
        return {"probe_steps": rows, "threads": threads}


def run_torch(
    job: PipelineJob,
    kind: str,
    me: int,
    stages: int,
    group: Any,
    device: torch.device = torch.device("cpu"),
) -> dict[str, Any]:
    """``job`` under torch.distributed.pipelining, with the runtime's split and data, on
    ``device`` (``cuda:N`` with ``--backend nccl``: each step's end waits for the GPU)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from learner.runtime.partition import balanced_boundaries, param_costs
    from learner.runtime.worker_state import prefer_foreach

    torch.manual_seed(job.seed)
    layers = [layer.to(dtype=job.dtype) for layer in job.build_layers()]
    bounds = balanced_boundaries(param_costs(layers), stages)
    module = nn.Sequential(*layers[bounds[me] : bounds[me + 1]]).to(device)
    cuda = device.type == "cuda"
    scale = 1.0 / job.microbatches  # as the runtime scales each microbatch's loss

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return job.loss_fn(out, target) * scale

    stage = PipelineStage(module, me, stages, device, group=group)
    schedule_cls = Schedule1F1B if kind == "1f1b" else ScheduleGPipe
    schedule = schedule_cls(stage, job.microbatches, loss_fn=loss_fn, scale_grads=False)
    # the optimizer implementation the runtime runs (its multi-tensor step where the job
    # left the choice to torch; the same arithmetic): the comparison is of the pipelines
    optimizer = prefer_foreach(job.optimizer(module.parameters()))
    first, last = me == 0, me == stages - 1
    times: list[float] = []
    ends: list[float] = []
    cpu: list[float] = []
    losses: list[float] = []
    phases: dict[int, dict[str, float]] = {}
    t_last = time.monotonic()
    probe = StepProbe()
    with _torch_phases(schedule, stage, phases) as at:
        for step in range(job.steps):
            at[0] = step
            mbs = [job.batch(step, 0, m) for m in range(job.microbatches)]
            x = torch.cat([b[0] for b in mbs]).to(device) if first else None
            y = torch.cat([b[1] for b in mbs]).to(device) if last else None
            t0 = time.monotonic()
            if first:
                schedule.step(x)
            elif last:
                got: list[torch.Tensor] = []
                schedule.step(target=y, losses=got)
                losses.append(float(sum(float(v.item()) for v in got)))
            else:
                schedule.step()
            if cuda:
                torch.cuda.synchronize(device)
            t1 = time.monotonic()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(device)
            now = time.monotonic()
            row = phases.setdefault(step, {})
            row["compute_phase"] = t1 - t0
            row["optimizer"] = now - t1
            row["sync_phase"] = now - t1
            times.append(now - t_last)
            ends.append(now)
            cpu.append(time.process_time())
            probe.mark()
            t_last = now
    return {
        "times": times,
        "ends": ends,
        "cpu": cpu,
        "losses": losses,
        "frc": None,
        "phase_steps": {str(k): v for k, v in sorted(phases.items())},
        **probe.close(),
    }


@contextlib.contextmanager
def _torch_phases(schedule: Any, stage: Any, phases: dict[int, dict[str, float]]) -> Any:
    """Time torch.distributed.pipelining's step by the runtime's phase names (``--profile``):
    forward (with the loss), backward, and the waits for its batched sends and receives.
    Yields ``[step]``, the step the times go to."""
    from torch.distributed.pipelining import schedules

    at = [0]

    def timed(fn: Any, name: str) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            t0 = time.monotonic()
            try:
                return fn(*a, **kw)
            finally:
                row = phases.setdefault(at[0], {})
                row[name] = row.get(name, 0.0) + time.monotonic() - t0

        return run

    wait = schedules._wait_batch_p2p
    schedules._wait_batch_p2p = timed(wait, "recv_wait")  # type: ignore[attr-defined]
    stage.forward_one_chunk = timed(stage.forward_one_chunk, "forward")
    stage.backward_one_chunk = timed(stage.backward_one_chunk, "backward")
    schedule._maybe_compute_loss = timed(schedule._maybe_compute_loss, "forward")
    try:
        yield at
    finally:
        schedules._wait_batch_p2p = wait  # type: ignore[attr-defined]


def run_rhizome(
    job: PipelineJob,
    opts: Any,
    etcd: str,
    job_id: str,
    store: Any,
    cap_to_plan: bool = False,
    snapshot_ahead: bool = True,
) -> dict[str, Any]:
    from learner.runtime.bubbles import FOR_BRC, IN_BUBBLE, IN_SYNC, OVERRUN
    from learner.runtime.cluster_state import EtcdClusterStateStore
    from learner.runtime.engine import Worker

    cluster = EtcdClusterStateStore(etcd, job_id)
    probe = StepProbe()
    try:
        worker = Worker(job, opts, cluster, store)
        worker.interpreter.cap_to_plan = cap_to_plan
        worker.snapshot_ahead = snapshot_ahead
        sync = worker._sync

        def sync_and_mark(step: int) -> None:
            sync(step)  # the step ends in here (Worker.step_ends)
            probe.mark()

        worker._sync = sync_and_mark  # type: ignore[method-assign]
        worker.run()
    finally:
        cluster.close()
    probed = probe.close()
    totals = worker.interpreter.frc_profile.totals(WARM)
    return {
        "times": [t for _, t in worker.step_times],
        "ends": worker.step_ends,
        "cpu": worker.step_cpu,
        "losses": [loss for _, loss in worker.loss_history],
        "frc": {
            "bubble_s": totals[IN_BUBBLE],
            "sync_s": totals[IN_SYNC],
            "overrun_s": totals[OVERRUN],
            "brc_s": totals[FOR_BRC],
        },
        # per step: seconds of FRC in bubbles / in the sync phase / before an eager BRC /
        # past the arrival of the message whose wait it filled
        "frc_steps": {
            str(step): [row[IN_BUBBLE], row[IN_SYNC], row[FOR_BRC], row[OVERRUN]]
            for step, row in sorted(worker.interpreter.frc_profile.per_step.items())
        },
        # per step: seconds the sync phase waited for the replica's update / applied one
        "sync_steps": {str(step): row for step, row in sorted(worker.sync_profile.items())},
        # per step: seconds in each phase of the step (WorkerState.phase)
        "phase_steps": {str(step): row for step, row in sorted(worker.state.phases.items())},
        **probed,
    }


def worker_main(args: argparse.Namespace) -> None:
    """Runs inside each launched worker process: every mode, interleaved, repeated."""
    from datetime import timedelta

    import torch.distributed as dist

    from contract.env import RuntimeEnv
    from learner.runtime.allocator import one_malloc_arena
    from learner.runtime.worker import options_from_env

    # as learner.runtime.worker.train does, for the whole process: torch's modes too
    if not args.per_thread_arenas:
        one_malloc_arena()
    torch.set_num_threads(1)
    env = RuntimeEnv.from_environ(os.environ)
    if args.pin:
        # one core per worker: the scheduler then cannot move a stage onto the core where
        # the other stage runs (other processes of the machine still share both)
        os.sched_setaffinity(0, {pin_cpus(env.stages)[env.worker]})
    opts = options_from_env(env)
    opts.verbose = False
    host, _, port = env.store.rpartition(":")
    store = dist.TCPStore(host, int(port), None, False, timeout=timedelta(seconds=120))
    device = torch.device(opts.device)
    if device.type == "cuda":
        # the launcher's GPU of this worker (learner.runtime.launch.worker_device)
        torch.cuda.set_device(device)
    # torch.distributed.pipelining sends through a process group of its own; the runtime
    # never uses the default group, so the two do not meet
    dist.init_process_group(
        "nccl" if env.backend == "nccl" else "gloo",
        store=dist.PrefixStore("torch-pipelining", store),
        rank=env.worker,
        world_size=env.stages,
    )
    results = Path(args.results)
    code = 0
    i = 0
    for rep in range(args.reps):
        for mode in args.modes.split(","):
            try:
                if mode in TORCH_MODES:
                    job = MODELS[args.model](args.steps, "none")
                    out = run_torch(job, TORCH_MODES[mode], env.worker, env.stages, None, device)
                else:
                    job = MODELS[args.model](args.steps, RZ_MODES_ALL[mode])
                    out = run_rhizome(
                        job,
                        opts,
                        env.etcd,
                        f"{env.job_id}-{i}",
                        dist.PrefixStore(f"run{i}", store),
                        cap_to_plan=mode == PLAN_CAPPED,
                        snapshot_ahead=mode not in SNAPSHOT_INLINE,
                    )
            except Exception as exc:
                print(f"ERROR in {mode}: {exc!r}", file=sys.stderr, flush=True)
                code = 1
                break
            # the workers share stdout: results go to one file each
            (results / f"w{env.worker}-run{i}.json").write_text(
                json.dumps({"worker": env.worker, "mode": mode, "rep": rep, **out})
            )
            i += 1
        if code:
            break
    sys.stdout.flush()
    os._exit(code)


def _siblings(cpu: int) -> str:
    """The hyper-threads of ``cpu``'s physical core, as the kernel lists them."""
    try:
        return Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
    except OSError:
        return str(cpu)


def pin_cpus(
    workers: int,
    cpus: list[int] | None = None,
    siblings: Any = _siblings,
) -> list[int]:
    """The CPU each worker is pinned to (``--pin``): one per physical core while there are
    enough, so two stages never share a core's execution units as hyper-threads (then a
    stage that fills its bubble with eager FRC slows its sibling's own compute, which a
    stage that waits does not); the first CPU of each core in order, then the others."""
    allowed = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    first: list[int] = []
    rest: list[int] = []
    seen: set[str] = set()
    for cpu in allowed:
        core = siblings(cpu)
        (rest if core in seen else first).append(cpu)
        seen.add(core)
    order = first + rest
    return [order[w % len(order)] for w in range(workers)]


# ------------------------------------------------------------------ driver side


def _stat_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` from ``/proc/<pid>/stat``, in seconds.

    The process's total, exited threads included (``schedstat`` per live thread would
    miss those); counted in clock ticks (10 ms), so a rate below 1 % of a core needs a
    window of seconds.
    """
    with contextlib.suppress(OSError, ValueError, IndexError):
        # fields after the command name, which may itself hold spaces or parentheses:
        # state is field 3, utime 14, stime 15
        rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(rest[11]) + int(rest[12])) / CLK_TCK
    return 0.0


def _cpu_ns(pid: int) -> int:
    """CPU time of every live thread of ``pid`` (``schedstat``: nanoseconds, not ticks)."""
    total = 0
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    return total


class CpuSampler:
    """``(time.monotonic(), schedstat CPU s, stat CPU s)`` of one process every 50 ms, in a
    thread.

    Two counters: the sum of the live threads' ``schedstat`` (nanoseconds; the earlier
    sessions' etcd column) and the process's ``utime + stime`` (``_stat_cpu_s``: exited
    threads too, 10 ms ticks; the steady figure). The CPU used over any window of the run
    is interpolated between the samples around it (workers' step ends are
    ``time.monotonic()`` too: one clock for every process of the machine).
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), _cpu_ns(self.pid) / 1e9, _stat_cpu_s(self.pid)))
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, t: float, stat: bool = False) -> float:
        """CPU seconds at monotonic time ``t`` (linear between samples): by ``schedstat``,
        or with ``stat`` by ``utime + stime``."""
        i = 2 if stat else 1
        s = self.samples
        for a, b in itertools.pairwise(s):
            if a[0] <= t <= b[0]:
                frac = 0.0 if b[0] == a[0] else (t - a[0]) / (b[0] - a[0])
                return a[i] + frac * (b[i] - a[i])
        return s[-1][i] if t > s[-1][0] else s[0][i]


def idle_window(pid: int, seconds: float) -> dict[str, float]:
    """etcd's CPU (``utime + stime``) over ``seconds`` with no job running, after letting
    whatever came before settle: the floor the steady figure is read against."""
    time.sleep(IDLE_SETTLE_S)
    t0, c0 = time.monotonic(), _stat_cpu_s(pid)
    time.sleep(seconds)
    t1, c1 = time.monotonic(), _stat_cpu_s(pid)
    return {"window_s": t1 - t0, "cpu_s": c1 - c0, "cores": (c1 - c0) / (t1 - t0)}


def launch(args: argparse.Namespace, etcd: str) -> list[dict[str, Any]]:
    results = Path(tempfile.mkdtemp(prefix="runtime-vs-torch-"))
    argv = [
        sys.executable,
        "-m",
        "learner.runtime.launch",
        "--stages",
        str(args.stages),
        "--etcd",
        etcd,
        "--job-id",
        f"bench-{uuid.uuid4().hex[:8]}",
        "--detection-timeout",
        "10",
        "--backend",
        args.backend,
        __file__,
        "--worker",
        "--steps",
        str(args.steps),
        "--reps",
        str(args.reps),
        "--modes",
        args.modes,
        "--model",
        args.model,
        "--results",
        str(results),
        *(["--pin"] if args.pin else []),
        *(["--per-thread-arenas"] if args.per_thread_arenas else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not args.json:
        print(f"# running {args.reps} x {len(args.modes.split(','))} runs ...", flush=True)
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1800, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = [json.loads(f.read_text()) for f in sorted(results.glob("*.json"))]
    shutil.rmtree(results, ignore_errors=True)
    return out


def args_steps(runs: list[dict[str, Any]]) -> int:
    return len(runs[0]["times"]) if runs else 0


def steady_from(args: argparse.Namespace) -> int:
    """The first step of the steady etcd window (``--steady-from``, else a quarter of the
    steps, and never inside the dropped warm-up)."""
    k = args.steady_from if args.steady_from is not None else args.steps // 4
    return min(max(WARM + 1, k), args.steps - 2)


def summarize(
    recs: list[dict[str, Any]],
    modes: list[str],
    stages: int,
    etcd_cpu: CpuSampler,
    first_steady: int = WARM + 1,
    idle: dict[str, dict[str, float]] | None = None,
) -> dict[str, Any]:
    """Per mode: iteration times, CPU, etcd's CPU (steps 3+, and steady: from the end of
    step ``first_steady - 1`` to the end of the last-but-one step), FRC; ``idle``: etcd's
    idle windows (``idle_window``) by name."""
    last = stages - 1
    per_mode: dict[str, dict[str, Any]] = {}
    for mode in modes:
        runs = [r for r in recs if r["mode"] == mode]
        lasts = [r for r in runs if r["worker"] == last]
        medians = [statistics.median(r["times"][WARM:]) * 1000 for r in lasts]
        row: dict[str, Any] = {
            "iter_ms": statistics.median(medians),
            "best_ms": min(medians),
            "reps_ms": medians,
        }
        # CPU in steady state: from the end of the warm-up steps to the end of the run
        cpu: dict[str, float] = {}
        cpu_step_s = 0.0  # CPU seconds per step, all workers together, mean over repetitions
        etcd_s = etcd_wall = 0.0
        steady_s = steady_wall = steady_sched_s = 0.0
        worker_step_ms: dict[str, float] = {}  # CPU ms per step of each worker
        for w in range(stages):
            used = wall = 0.0
            w_runs = [r for r in runs if r["worker"] == w]
            for r in w_runs:
                used += r["cpu"][-1] - r["cpu"][WARM - 1]
                wall += r["ends"][-1] - r["ends"][WARM - 1]
                per_step = (r["cpu"][-1] - r["cpu"][WARM - 1]) / (len(r["cpu"]) - WARM)
                cpu_step_s += per_step
                worker_step_ms[f"worker{w}"] = worker_step_ms.get(
                    f"worker{w}", 0.0
                ) + 1000 * per_step / len(w_runs)
                if w == last:
                    t0, t1 = r["ends"][WARM - 1], r["ends"][-1]
                    etcd_s += etcd_cpu.at(t1) - etcd_cpu.at(t0)
                    etcd_wall += t1 - t0
                    # steady: start-up and finish left out (see the module docstring)
                    ends = r["ends"]
                    if len(ends) >= first_steady + 2:
                        s0, s1 = ends[first_steady - 1], ends[-2]
                        steady_s += etcd_cpu.at(s1, stat=True) - etcd_cpu.at(s0, stat=True)
                        # the same window by the finer counter: how much the ticks blur
                        steady_sched_s += etcd_cpu.at(s1) - etcd_cpu.at(s0)
                        steady_wall += s1 - s0
            cpu[f"worker{w}"] = used / wall if wall else 0.0
        row["cpu_cores"] = cpu
        row["cpu_ms_per_step"] = 1000 * cpu_step_s / max(1, len(lasts))
        row["cpu_ms_per_step_worker"] = worker_step_ms
        row["etcd_cpu_cores"] = etcd_s / etcd_wall if etcd_wall else 0.0
        row["etcd_steady_cpu_cores"] = steady_s / steady_wall if steady_wall > 0 else None
        row["etcd_steady_window_s"] = steady_wall
        row["etcd_steady_schedstat_cpu_cores"] = (
            steady_sched_s / steady_wall if steady_wall > 0 else None
        )
        row["losses"] = lasts[0]["losses"] if lasts else []
        frc = [r["frc"] for r in runs if r["frc"] is not None]
        spent = {
            k: sum(f.get(k, 0.0) for f in frc) for k in ("bubble_s", "sync_s", "overrun_s", "brc_s")
        }
        total = sum(spent.values())
        row["frc_bubble_share"] = spent["bubble_s"] / total if total else None
        # per worker that ran FRC and per measured step
        per = max(1, len(frc)) * max(1, args_steps(lasts) - WARM)
        row["frc_ms_per_step"] = (
            {k.removesuffix("_s"): 1000 * v / per for k, v in spent.items()} if total else None
        )
        per_mode[mode] = row
    ref = per_mode.get("torch-1f1b")
    none = per_mode.get("rz-none")
    matched = True
    for row in per_mode.values():
        if ref is not None:
            row["vs_torch_1f1b"] = row["iter_ms"] / ref["iter_ms"]
            row["best_vs_torch_1f1b"] = row["best_ms"] / ref["best_ms"]
            diffs = [abs(a - b) for a, b in zip(row["losses"], ref["losses"], strict=False)]
            equal_len = len(row["losses"]) == len(ref["losses"])
            row["max_loss_diff"] = max(diffs) if diffs else None
            matched = matched and equal_len and bool(diffs) and max(diffs) <= LOSS_TOL
        if none is not None:
            row["vs_rz_none"] = row["iter_ms"] / none["iter_ms"]
    windows = [w for w in (idle or {}).values() if w["window_s"] > 0]
    idle_cores = (
        sum(w["cpu_s"] for w in windows) / sum(w["window_s"] for w in windows) if windows else None
    )
    return {
        "modes": per_mode,
        "losses_match": matched,
        # etcd's steady window: steps first_steady .. steps-2 of every repetition
        "steady_from_step": first_steady,
        "etcd_idle_cpu_cores": idle_cores,
        "etcd_idle_windows": idle or {},
    }


def report(summary: dict[str, Any], args: argparse.Namespace) -> None:
    modes = summary["modes"]
    print(
        f"# runtime_vs_torch: {args.stages} stages, "
        f"{'NCCL, one GPU per stage' if args.backend == 'nccl' else 'gloo/CPU'}, "
        "1 torch thread per process, "
        f"{os.cpu_count()} cores (shared)"
        f"{f', workers pinned to CPUs {pin_cpus(args.stages)}' if args.pin else ''}; "
        f"model {args.model}, 4 microbatches; "
        f"{args.steps} steps per run (first {WARM} dropped), {args.reps} interleaved repetitions"
    )
    k = summary["steady_from_step"]
    print(
        "| mode | iteration ms (median) | best | vs torch 1F1B | best vs best | vs rz none "
        f"| max loss diff | CPU per worker (cores) | etcd CPU (steps {WARM}+) "
        f"| etcd steady (steps {k}+) | FRC in bubbles |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for mode, row in modes.items():
        cpu = " / ".join(f"{v:.2f}" for v in row["cpu_cores"].values())
        share = row["frc_bubble_share"]
        diff = row.get("max_loss_diff")
        steady = row["etcd_steady_cpu_cores"]
        print(
            f"| {mode} | {row['iter_ms']:.1f} | {row['best_ms']:.1f} "
            f"| {row.get('vs_torch_1f1b', float('nan')):.3f} "
            f"| {row.get('best_vs_torch_1f1b', float('nan')):.3f} "
            f"| {row.get('vs_rz_none', float('nan')):.3f} "
            f"| {'-' if diff is None else f'{diff:.1e}'} | {cpu} "
            f"| {row['etcd_cpu_cores'] * 100:.2f} % "
            f"| {'-' if steady is None else f'{steady * 100:.2f} %'} "
            f"| {'-' if share is None else f'{share * 100:.0f} %'} |"
        )
    for mode, row in modes.items():
        if row.get("frc_ms_per_step"):
            f = row["frc_ms_per_step"]
            print(
                f"# {mode}: FRC per step per worker: {f['bubble']:.1f} ms in bubbles, "
                f"{f['sync']:.1f} ms in the sync phase with nothing awaited, "
                f"{f['overrun']:.1f} ms past a message's arrival (overrun), "
                f"{f['brc']:.1f} ms before an eager BRC"
            )
    # what the machine allows: the workers' CPU per step spread over every core is a floor
    # no schedule beats (the CPU includes every thread of the worker processes); pinned,
    # each worker has one core, so the busiest worker's CPU per step is the floor
    cores = os.cpu_count() or 1
    base = modes.get("rz-none")
    for mode, row in modes.items():
        per_worker = row["cpu_ms_per_step_worker"]
        if args.pin:
            floor = max(per_worker.values(), default=0.0)
            where = "on one core per worker (pinned)"
        else:
            floor = row["cpu_ms_per_step"] / cores
            where = f"on {cores} cores"
        rel = f" = {floor / base['iter_ms']:.3f}x rz-none's median" if base else ""
        each = " / ".join(f"{v:.1f}" for v in per_worker.values())
        print(
            f"# {mode}: workers' CPU {row['cpu_ms_per_step']:.1f} ms per step ({each}); "
            f"{where} no schedule runs a step in under {floor:.1f} ms{rel}"
        )
    print(f"losses match torch 1F1B within {LOSS_TOL:g}: {summary['losses_match']}")
    for mode, (base, goal) in GOALS.items():
        if mode in modes and base in modes:
            ratio = modes[mode]["iter_ms"] / modes[base]["iter_ms"]
            verdict = "met" if ratio <= goal else "NOT met"
            print(f"goal: {mode} <= {goal:.2f}x {base}: {ratio:.3f} -> {verdict}")
    idle = summary["etcd_idle_cpu_cores"]
    windows = summary["etcd_idle_windows"]
    window_s = max((row["etcd_steady_window_s"] for row in modes.values()), default=0.0)
    print(
        f"# etcd CPU (steps {WARM}+): its threads' schedstat from the end of step {WARM - 1} "
        "to the end of each run's last step (the earlier sessions' column); "
        f"etcd steady (steps {k}+): utime+stime of the etcd process (10 ms ticks) from the "
        f"end of step {k - 1} to the end of step {args.steps - 2} of every repetition, "
        f"{window_s:.1f} s per mode; etcd idle (no job): "
        + (
            ", ".join(
                f"{w['cores'] * 100:.2f} % {name} ({w['window_s']:.0f} s)"
                for name, w in windows.items()
            )
            if windows
            else "not measured (--idle-s 0)"
        )
    )
    # the floors: etcd with no job at all, and etcd while torch trains (torch never
    # talks to it) in the same steady window
    torch_steady = modes.get("torch-1f1b", {}).get("etcd_steady_cpu_cores")
    for mode in (m for m in modes if m.startswith("rz-")):
        etcd = modes[mode]["etcd_steady_cpu_cores"]
        if etcd is None:
            continue
        verdict = "met" if etcd < ETCD_GOAL else "NOT met"
        over = [] if idle is None else [f"{(etcd - idle) * 100:+.2f} % over etcd idle"]
        if torch_steady is not None:
            over.append(f"{(etcd - torch_steady) * 100:+.2f} % over its level while torch trains")
        print(
            f"goal: etcd CPU in steady training < 1 % of a core during {mode}: "
            f"{etcd * 100:.2f} % ({'; '.join(over)}; schedstat over the same window: "
            f"{modes[mode]['etcd_steady_schedstat_cpu_cores'] * 100:.2f} %; steps {WARM}+ "
            f"column: {modes[mode]['etcd_cpu_cores'] * 100:.2f} %) -> {verdict}"
        )


def sync_profile(recs: list[dict[str, Any]], stages: int) -> None:
    """``--profile``: per mode and stage, the mean ms per measured step that the sync phase
    spent waiting for the replica's update and applying a replica update on the step
    loop's own thread (on the critical path)."""
    rows = [r for r in recs if r.get("sync_steps")]
    if not rows:
        return
    keys = sorted({k for r in rows for row in r["sync_steps"].values() for k in row})
    print(f"\n# --profile sync phase: ms per step (steps {WARM}+), mean over repetitions")
    print("| mode | worker (stage) | " + " | ".join(keys) + " |")
    print("| --- | --- |" + " ---: |" * len(keys))
    for mode in sorted({r["mode"] for r in rows}):
        for w in sorted({r["worker"] for r in rows if r["mode"] == mode}):
            got = [
                row
                for r in rows
                if r["mode"] == mode and r["worker"] == w
                for step, row in r["sync_steps"].items()
                if int(step) >= WARM
            ]
            cells = [f"{1000 * statistics.mean(g.get(k, 0.0) for g in got):.1f}" for k in keys]
            print(f"| {mode} | {w} ({w % stages}) | " + " | ".join(cells) + " |")


# the phases of --profile's per-phase table, in the order of a step; "other" is the rest
# of the iteration (the step loop's own bookkeeping, thread hand-offs, the block thread's
# own work between its instructions)
PHASES = [
    ("step_setup", "step set-up (frees the last step's records)"),
    ("forward", "forward (+ loss)"),
    ("backward", "backward (+ accumulate)"),
    ("frc", "eager FRC in waits"),
    ("brc", "eager BRC"),
    ("recv_wait", "receive waits"),
    ("send_post", "send posts"),
    ("send_wait", "send waits"),
    ("load", "batch load"),
    ("stash", "gradient stash"),
    ("allreduce", "all-reduce"),
    ("snapshot", "snapshot"),
    ("optimizer", "optimizer"),
    ("leftover_frc", "left-over FRC"),
    ("replica_wait", "replica update wait"),
    ("update_send_wait", "update send wait"),
]


def phase_profile(recs: list[dict[str, Any]], stages: int) -> None:
    """``--profile``: where each stage's iteration goes, ms per step (steps ``WARM``+),
    median over steps of every repetition: the runtime's own phase record
    (``WorkerState.phase``) and the same names timed around torch.distributed.pipelining."""
    rows = [r for r in recs if r.get("phase_steps")]
    if not rows:
        return
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    cols = [(m, w) for m in modes for w in range(stages)]
    print(
        f"\n# --profile phases: ms per iteration (steps {WARM}+, mean over steps and repetitions); "
        "'other' = iteration - the phases above (bookkeeping, thread hand-offs)"
    )
    print("| phase | " + " | ".join(f"{m} s{w}" for m, w in cols) + " |")
    print("| --- |" + " ---: |" * len(cols))

    def mean_of(mode: str, w: int, fn: Any) -> float:
        vals = [
            fn(r, int(k), row)
            for r in rows
            if r["mode"] == mode and r["worker"] == w
            for k, row in r["phase_steps"].items()
            if int(k) >= WARM and int(k) < len(r["times"])
        ]
        return 1000 * statistics.mean(vals) if vals else float("nan")

    names = [
        (k, label)
        for k, label in PHASES
        if any(k in row for r in rows for row in r["phase_steps"].values())
    ]
    for key, label in names:
        cells = [mean_of(m, w, lambda r, k, row, key=key: row.get(key, 0.0)) for m, w in cols]
        print(f"| {label} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    keys = [k for k, _ in names]
    other = [
        mean_of(m, w, lambda r, k, row: r["times"][k] - sum(row.get(x, 0.0) for x in keys))
        for m, w in cols
    ]
    print("| other | " + " | ".join(f"{c:.1f}" for c in other) + " |")
    iters = [mean_of(m, w, lambda r, k, row: r["times"][k]) for m, w in cols]
    print("| iteration | " + " | ".join(f"{c:.1f}" for c in iters) + " |")
    for name, label in (("compute_phase", "compute phase"), ("sync_phase", "sync phase")):
        cells = [mean_of(m, w, lambda r, k, row, n=name: row.get(n, 0.0)) for m, w in cols]
        print(f"| ({label}) | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


def steadiness_profile(recs: list[dict[str, Any]], stages: int) -> None:
    """``--profile``: why a mode's repetitions differ — per mode, each repetition's median
    and 90th-percentile iteration (last stage, steps ``WARM``+), and per worker the mean per
    step of the collector's pauses, minor page faults and context switches (``StepProbe``)."""
    rows = [r for r in recs if r.get("probe_steps")]
    if not rows:
        return
    last = stages - 1
    print(
        f"\n# --profile steadiness: per repetition, the last stage's iteration ms (median / "
        f"p90, steps {WARM}+; its GC pause ms per step, its process's threads at the end); "
        "per step, mean over repetitions, "
        "per worker: GC pause ms, gen-2 collections per run, minor page faults, voluntary / "
        "involuntary context switches"
    )
    print(
        "| mode | reps: median / p90 ms | worker | GC ms | gen-2 per run | faults | vol cs | invol cs |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for mode in dict.fromkeys(r["mode"] for r in rows):
        lasts = sorted(
            (r for r in rows if r["mode"] == mode and r["worker"] == last), key=lambda r: r["rep"]
        )
        reps = []
        for r in lasts:
            t = sorted(r["times"][WARM:])
            gc_ms = 1000 * statistics.mean(row[0] for row in r["probe_steps"][WARM:])
            reps.append(
                f"{1000 * statistics.median(t):.1f} / {1000 * t[int(0.9 * (len(t) - 1))]:.1f}"
                f" (GC {gc_ms:.2f}, {r.get('threads', 0)} threads)"
            )
        for w in range(stages):
            runs = [r for r in rows if r["mode"] == mode and r["worker"] == w]
            steps = [row for r in runs for row in r["probe_steps"][WARM:]]
            if not steps:
                continue
            mean = [statistics.mean(row[i] for row in steps) for i in range(5)]
            gen2 = sum(row[1] for row in steps) / len(runs)
            print(
                f"| {mode} | {', '.join(reps) if w == 0 else ''} | {w} | {1000 * mean[0]:.2f} "
                f"| {gen2:.1f} | {mean[2]:.0f} | {mean[3]:.0f} | {mean[4]:.0f} |"
            )


def profile(recs: list[dict[str, Any]], stages: int) -> None:
    """``--profile``: per stage and step, ms of eager FRC inside bubbles and in the sync phase."""
    phase_profile(recs, stages)
    sync_profile(recs, stages)
    steadiness_profile(recs, stages)
    for mode in sorted({r["mode"] for r in recs if r.get("frc_steps")}):
        print(
            f"\n# --profile {mode}: FRC ms per step, in bubbles / on the critical path "
            "(sync phase with nothing awaited + overruns)"
        )
        runs = [r for r in recs if r["mode"] == mode and r.get("frc_steps")]
        # the first steps only: with 40 steps a row of all of them is too wide to read
        # (the sync-phase table above and the summary line cover every step)
        steps = sorted({int(k) for r in runs for k in r["frc_steps"]})[:PROFILE_STEPS]
        print("| worker (stage) | rep | " + " | ".join(f"step {k}" for k in steps) + " |")
        print("| --- | ---: |" + " ---: |" * len(steps))
        for r in sorted(runs, key=lambda r: (r["worker"], r["rep"])):
            cells = []
            for k in steps:
                bubble, sync, _, over = r["frc_steps"].get(str(k), [0.0, 0.0, 0.0, 0.0])
                cells.append(f"{bubble * 1000:.0f} / {(sync + over) * 1000:.0f}")
            print(
                f"| {r['worker']} ({r['worker'] % stages}) | {r['rep']} | "
                + " | ".join(cells)
                + " |"
            )


def lease_refresh_cost(refreshes: int, as_json: bool) -> None:
    """``--lease-refreshes N``: etcd's CPU per lease refresh, a new LeaseKeepAlive stream per
    refresh (the client library's ``refresh_lease``, what the runtime did before) against
    one kept stream (``contract.etcd.Lease.refresh``), in blocks of 50 alternating, in one
    run against one private etcd; and what that costs at the runtime's rate (every worker
    refreshed every TTL/4 until session 10, every TTL/3 since: 2 workers at TTL 2 s were
    4 refreshes a second; the figure below keeps that rate, comparable with earlier runs)."""
    from contract.etcd import EtcdClient
    from learner.runtime.launch import private_etcd_process

    block = 50
    kept, fresh = "one kept stream", "new stream per refresh"
    spent = {fresh: 0, kept: 0}
    blocks = max(1, refreshes // block)
    with private_etcd_process() as (url, pid):
        client = EtcdClient(url)
        lease = client.grant(10)
        try:
            lease.refresh()  # opens the kept stream outside the measured blocks
            for i in range(blocks):
                for way in (fresh, kept) if i % 2 == 0 else (kept, fresh):
                    c0 = _cpu_ns(pid)
                    for _ in range(block):
                        if way == kept:
                            lease.refresh()
                        else:
                            list(client.raw.refresh_lease(lease.id))
                    spent[way] += _cpu_ns(pid) - c0
        finally:
            lease.revoke()
            client.close()
    n = blocks * block
    per = {way: ns / n / 1000 for way, ns in spent.items()}  # microseconds per refresh
    rate = 2 * 4  # refreshes per second: 2 workers, TTL 2 s, every TTL/4 (as recorded before)
    out = {
        "refreshes_each": n,
        "etcd_cpu_us_per_refresh": per,
        "kept_vs_new": per[kept] / per[fresh],
        "core_share_at_runtime_rate": {way: us * rate / 1e6 for way, us in per.items()},
    }
    if as_json:
        print(json.dumps(out, indent=2))
        return
    print(f"# lease refresh cost in etcd, {n} refreshes each way, blocks of {block} alternating")
    print("| way | etcd CPU per refresh (us) | at 2 workers x 4 refreshes/s (% of a core) |")
    print("| --- | ---: | ---: |")
    for way, us in per.items():
        print(f"| {way} | {us:.1f} | {us * rate / 1e4:.3f} % |")
    print(f"one kept stream / new stream per refresh: {out['kept_vs_new']:.2f}")


def driver(args: argparse.Namespace) -> None:
    if args.lease_refreshes:
        lease_refresh_cost(args.lease_refreshes, args.json)
        return
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in ALL_MODES and m not in EXTRA_MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; use some of {','.join(ALL_MODES)}")
    if not 2 <= args.stages <= 4:
        raise SystemExit(f"--stages {args.stages}: use 2, 3 or 4")
    from learner.runtime.launch import private_etcd_process

    idle: dict[str, dict[str, float]] = {}
    with private_etcd_process() as (url, pid):
        sampler = CpuSampler(pid)
        try:
            if args.idle_s > 0:
                idle["before"] = idle_window(pid, args.idle_s)
            recs = launch(args, url)
            if args.idle_s > 0:
                idle["after"] = idle_window(pid, args.idle_s)
        finally:
            sampler.stop()
    summary = summarize(recs, modes, args.stages, sampler, steady_from(args), idle)
    if args.json:
        for row in summary["modes"].values():
            row.pop("losses", None)
        print(json.dumps(summary, indent=2))
    else:
        report(summary, args)
        if args.profile:
            profile(recs, args.stages)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help="steps per run (first 3 dropped)"
    )
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions of every mode")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (2-4)")
    p.add_argument(
        "--modes",
        default=",".join(ALL_MODES),
        help=f"comma-separated modes; also {PLAN_CAPPED} (eager FRC filled exactly as planned) "
        f"and {', '.join(SNAPSHOT_INLINE)} (the pre-update snapshot in the sync phase)",
    )
    p.add_argument(
        "--model",
        default="gpt",
        choices=sorted(MODELS),
        help="gpt: the char GPT of examples/pipeline-gpt (the figures); tiny: the tests' MLP",
    )
    p.add_argument(
        "--steady-from",
        type=int,
        default=None,
        metavar="K",
        help="etcd's steady window starts at the end of step K-1 (default: steps // 4, "
        f"at least {WARM + 1})",
    )
    p.add_argument(
        "--idle-s",
        type=float,
        default=10.0,
        help="seconds of etcd with no job, before the first run and after the last (0: skip)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also print, per stage and step, ms of eager FRC in bubbles and in the sync phase",
    )
    p.add_argument(
        "--lease-refreshes",
        type=int,
        default=0,
        metavar="N",
        help="instead: etcd's CPU per lease refresh, new stream each vs one kept stream",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="pin each worker to a CPU of its own, one per physical core while there are enough",
    )
    p.add_argument(
        "--per-thread-arenas",
        action="store_true",
        help="leave glibc's malloc one arena per thread in the workers, as before session 13 "
        "(learner/runtime/allocator.py), for a before/after pair",
    )
    p.add_argument(
        "--backend",
        default="gloo",
        choices=("gloo", "nccl"),
        help="gloo: every stage on CPU (the figures of this machine); nccl: stage s on GPU s "
        "(needs one GPU per stage: NCCL refuses two ranks on one GPU)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--results", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker_main(args)
    else:
        if args.steps <= WARM + 1:
            raise SystemExit(f"--steps {args.steps}: need more than {WARM + 1}")
        if args.backend == "nccl" and torch.cuda.device_count() < args.stages:
            raise SystemExit(
                f"--backend nccl needs one GPU per stage: {args.stages} stages, "
                f"{torch.cuda.device_count()} GPU(s) visible (NCCL refuses two ranks on one "
                "GPU)"
            )
        driver(args)


if __name__ == "__main__":
    main()
