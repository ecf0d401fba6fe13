"""The spot simulator's prediction next to the same job run on the platform under
`rhizome inject --job` with the same (time-scaled) trace (issue #20's cross-check).

The job is synthetic and step-timed: STEPS steps of STEP_S seconds each (a sleep), an
adaptive-checkpointing learner (the SDK: Daly insurance saves from the MTTP it is given,
an emergency save on SIGTERM, resume from the newest committed checkpoint), a save that
takes SAVE_S. It runs on a throwaway embedded platform (real etcd, MongoDB-wire server,
daemon with API + LCM; guardians and learner controllers as processes). The injector
replays a bundled trace, divided by --time-scale, with the simulator's mapping (a removal
is the job's with probability learners / nodes alive, seeded). The simulator gets the
same hits (the same seeded schedule, `trace_schedule`), the same notice, step, save and
MTTP, and the platform's restart time measured in this run (the median gap from a
learner's last step to its successor's start): that one input is calibrated, everything
else is given.

Printed side by side: time to finish, preemptions delivered, restarts, share of the time
spent on new training steps, and each ratio platform / simulator.

    .venv/bin/python benchmarks/sim_vs_platform.py [--trace aws-p3-64.csv] [--time-scale 500]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from _platform import ROOT, BenchPlatform, run_under_trace

from services.injector.injector import trace_schedule
from services.sim.engine import Sim
from services.sim.model import JobSpec, PreemptionModel, Prices
from services.sim.strategies import Adaptive, platform_mttp_s
from services.sim.traces import Trace, TraceEvent

# The learner: a step is a sleep, a checkpoint is {"step": n} (SAVE_S more of sleep).
TRAIN = textwrap.dedent(
    """
    import argparse, json, sys, time
    import learner.sdk as rz

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int)
    p.add_argument("--step-s", type=float)
    p.add_argument("--save-s", type=float)
    p.add_argument("--progress")
    a = p.parse_args()
    ckpt = rz.latest_checkpoint()
    start = json.loads(open(ckpt.path).read())["step"] if ckpt else 0
    log = open(a.progress, "a", buffering=1)
    log.write(json.dumps({"event": "start", "from": start, "t": time.time()}) + "\\n")
    for i in range(start, a.steps):
        with rz.step():
            time.sleep(a.step_s)
        log.write(json.dumps({"step": i + 1, "t": time.time()}) + "\\n")
        if rz.should_save():
            path = rz.staging_path("state.json")
            time.sleep(a.save_s)
            path.write_text(json.dumps({"step": i + 1}))
            rz.backup(path, step=i + 1)
    rz.close()
    log.write(json.dumps({"event": "done", "t": time.time()}) + "\\n")
    """
)


def platform_run(args: argparse.Namespace, mttp_s: float, work: Path) -> dict[str, Any]:
    code = work / "code"
    code.mkdir()
    (code / "train.py").write_text(TRAIN)
    # The learner may run under a uid of its own (docs/security.md): it appends here.
    work.chmod(0o755)
    shared = work / "progress"
    shared.mkdir()
    shared.chmod(0o1777)
    progress = shared / "progress.jsonl"
    manifest = textwrap.dedent(
        f"""
        name: sim-vs-platform
        memory: 256MiB
        max_learner_restarts: 100
        checkpoint:
          policy: adaptive
          grace_s: {args.notice}
        env:
          PYTHONPATH: "{ROOT}"
          RHIZOME_MTTP_S: "{mttp_s}"
          RHIZOME_RESTART_S: "{args.restart_prior}"
          RHIZOME_SAVE_S: "{args.save_s}"
          RHIZOME_BACKUP_S: "0.05"
        framework:
          command: "{sys.executable} train.py --steps {args.steps} --step-s {args.step_s} --save-s {args.save_s} --progress {progress}"
        """
    )
    with BenchPlatform() as platform:
        record, out = run_under_trace(
            platform,
            manifest,
            code,
            progress,
            trace=args.trace,
            time_scale=args.time_scale,
            notice=args.notice,
            seed=args.seed,
            # A trace's time is when the node goes; the simulator announces it `notice`
            # earlier, the injector sends SIGTERM at the scheduled time: shift by it.
            injector_args=["--delay", str(-args.notice)],
            start_timeout_s=120,
            end_timeout_s=900,
        )
    if record.status != "COMPLETED":
        raise SystemExit(f"the job ended {record.status}; see {work}")
    injections = json.loads(out)
    rows = [json.loads(line) for line in progress.read_text().splitlines()]
    return {"rows": rows, "injections": injections}


def summarise(run: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    rows = run["rows"]
    starts = [r for r in rows if r.get("event") == "start"]
    steps = [r for r in rows if "step" in r]
    t0 = starts[0]["t"]
    # The last "done": a preemption between the script's last step and its exit restarts
    # it from its newest checkpoint, and it trains those steps again.
    end = [r["t"] for r in rows if r.get("event") == "done"][-1]
    total = end - t0
    delivered = [i for i in run["injections"] if i["outcome"] != "missed"]
    # Restart gaps: from the last step logged before a restart to the restart's start —
    # the whole outage (emergency save, exit, the guardian's restart, the interpreter's
    # start). The learner leaves as soon as it has saved; it does not wait out the notice.
    gaps = []
    for s in starts[1:]:
        before = [r["t"] for r in steps if r["t"] < s["t"]]
        if before:
            gaps.append(s["t"] - before[-1])
    return {
        "time_s": total,
        # The simulator counts every hit before the job is done, in whatever state the
        # job is; the injector stops when the job has ended.
        "preemptions": len(run["injections"]),
        "delivered": len(delivered),
        "restarts": len(starts) - 1,
        "training_share": args.steps * args.step_s / total,
        "restart_s": statistics.median(gaps) if gaps else 0.0,
    }


def simulate(args: argparse.Namespace, hits: list[float], restart_s: float) -> dict[str, float]:
    # Only the job's hits, one removal each on a one-node "cluster" (probability 1), and a
    # closing event far past the run so the replay does not wrap around.
    events = [TraceEvent(t, "remove", "n") for t in hits] + [TraceEvent(1e7, "add", "n")]
    model = PreemptionModel(
        notice_s=args.notice,
        trace=Trace("scaled", tuple(events)),
        random_offset=False,
    )
    job = JobSpec(
        name="sim-vs-platform",
        steps=args.steps,
        step_s=args.step_s,
        save_s=args.save_s,
        backup_s=0.05,
        alloc_s=(restart_s, restart_s),
        prep_s=(0.0, 0.0),
    )
    result = Sim(job, model, Adaptive(args.mttp_s), Prices(3.06, 0.918), seed=args.seed).run()
    return {
        "time_s": result.time_s,
        "preemptions": result.preemptions,
        "delivered": float("nan"),
        "restarts": result.restarts,
        "training_share": result.breakdown["compute"] / result.time_s,
        "restart_s": restart_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", default="aws-p3-64.csv")
    parser.add_argument("--time-scale", type=float, default=500.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--step-s", type=float, default=0.1)
    parser.add_argument("--save-s", type=float, default=0.2)
    parser.add_argument("--notice", type=float, default=3.0)
    parser.add_argument("--restart-prior", type=float, default=2.0)
    parser.add_argument(
        "--work", type=Path, default=None, help="keep the learner's progress log here (new dir)"
    )
    args = parser.parse_args()
    # One learner: the same seeded hits the injector draws (`--job` with 1 learner).
    hits = trace_schedule(args.trace, time_scale=args.time_scale, job_nodes=1, seed=args.seed)
    probe = PreemptionModel(
        notice_s=args.notice,
        trace=Trace("scaled", tuple(TraceEvent(t, "remove", "n") for t in hits)),
        random_offset=False,
    )
    spec = JobSpec("probe", args.steps, args.step_s, args.save_s, 0.05)
    args.mttp_s = platform_mttp_s(spec, probe)
    print(
        f"{len(hits)} hits on the job in the scaled trace; MTTP given to both {args.mttp_s:.1f} s",
        file=sys.stderr,
    )
    if args.work is not None:
        args.work.mkdir(parents=True)
        real = summarise(platform_run(args, args.mttp_s, args.work), args)
    else:
        with tempfile.TemporaryDirectory(prefix="sim-vs-platform-") as tmp:
            real = summarise(platform_run(args, args.mttp_s, Path(tmp)), args)
    sim = simulate(args, hits, real["restart_s"])
    print(f"\ntrace {args.trace} / {args.time_scale:g}, seed {args.seed}, notice {args.notice} s")
    print("| figure | platform | simulator | platform / simulator |")
    print("| --- | --- | --- | --- |")
    for key, label, fmt in (
        ("time_s", "time to finish (s)", "{:.1f}"),
        ("preemptions", "preemptions (trace hits before the job ended)", "{:.0f}"),
        ("delivered", "of which found a learner running", "{:.0f}"),
        ("restarts", "restarts", "{:.0f}"),
        ("training_share", "share of time on new steps", "{:.1%}"),
        ("restart_s", "restart time (s; simulator input)", "{:.2f}"),
    ):
        a, b = real[key], sim[key]
        ratio = f"{a / b:.2f}" if b == b and b else "-"
        shown_b = fmt.format(b) if b == b else "-"
        print(f"| {label} | {fmt.format(a)} | {shown_b} | {ratio} |")


if __name__ == "__main__":
    main()
