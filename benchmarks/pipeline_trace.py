"""A pipeline job on the platform under a slice of the p3 preemption trace, next to the
spot simulator's `redundant` (Bamboo) prediction for the same hits (issue #16).

    .venv/bin/python benchmarks/pipeline_trace.py [--trace aws-p3-64.csv] [--time-scale 200]
        [--start 0] [--seed 0] [--steps 500] [--step-sleep 0.2]

The job: the runtime's float64 toy (learner/runtime/toy.py), 2 stages × 1 pipeline, each
step held `--step-sleep` seconds (stage 0 sleeps while it reads its batch), on a
throwaway platform (real etcd and MongoDB-wire server, a daemon with the API, the
scheduler and the LCM; guardians and learners as processes, local backend). Each
learner's stdout passes through a stamp that writes the runtime's `step N ... generation G`
lines with their wall time to a shared progress file.

`rhizome inject --job` (`python -m services.injector`) replays the trace from `--start`
seconds on, divided by `--time-scale`, with the simulator's mapping (a removal is the
job's with probability learners / nodes alive, seeded): SIGTERM to a PROCESSING learner,
SIGKILL `--notice` later. The pipeline fails over (the guardian names it), the guardian
starts a replacement that joins, and a second hit before that join (a stage and its
shadow: with 2 stages, any two learners) restarts the job from its block checkpoint
(every 10 steps).

The simulator gets the same hits (the same seeded schedule, `trace_schedule`, every one
the job's) and the platform's own figures measured in this run, each named in the output:
the steady step time, the failover and reconfiguration pauses, the slowdown while a shadow
serves two stages, the block checkpoint interval, and the time new nodes take. The
simulator has one figure for that (its allocation) where the platform has two: a
replacement's join after a failover (one learner's cold start) and a restart from the
checkpoint after a fatal loss (every learner's, links and blocks loaded), so it runs
twice, A with the first and B with the second. Everything else — when the hits land,
which stage, whether two overlap — the simulator works out itself.

Printed side by side with the ratios platform / A and platform / B: time to finish, share
of the time on new steps, failovers, restarts from the checkpoint (fatal losses), hits.
"""

from __future__ import annotations

import argparse
import itertools
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
from services.sim.strategies import RedundancyParams, Redundant
from services.sim.traces import Trace, TraceEvent

# The training script: the toy through the runtime, a sleep per step (stage 0's batch of
# microbatch 0), and every `step ...` line the last stage prints stamped with wall time.
TRAIN = textwrap.dedent(
    """
    import json, os, sys, time
    from learner.runtime.toy import toy_job
    from learner.runtime.worker import train

    steps, sleep_s, progress = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    rank = os.environ.get("RHIZOME_RANK", "?")

    class Stamp:
        def __init__(self, inner):
            self.inner = inner
            self.out = open(progress, "a", buffering=1)

        def write(self, text):
            for line in text.splitlines():
                if line.startswith("step "):
                    row = {"t": time.time(), "rank": rank, "line": line}
                    self.out.write(json.dumps(row) + "\\n")
            return self.inner.write(text)

        def flush(self):
            self.inner.flush()

    sys.stdout = Stamp(sys.stdout)
    job = toy_job(steps=steps, microbatches=2)
    inner = job.batch

    def batch(step, pipeline, microbatch):
        if microbatch == 0:
            time.sleep(sleep_s)
        return inner(step, pipeline, microbatch)

    job.batch = batch
    train(job)
    """
)


def platform_run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    code = work / "code"
    code.mkdir()
    (code / "train.py").write_text(TRAIN)
    work.chmod(0o755)  # the learner may run under a uid of its own: it appends here
    shared = work / "progress"
    shared.mkdir()
    shared.chmod(0o1777)
    progress = shared / "progress.jsonl"
    manifest = textwrap.dedent(
        f"""
        name: pipeline-trace
        memory: 512MiB
        max_learner_restarts: 100
        pipeline: {{stages: 2, pipelines: 1}}
        env:
          PYTHONPATH: "{ROOT}"
        framework:
          command: "python train.py {a.steps} {a.step_sleep} {progress}"
        """
    )
    cluster = ROOT / "deploy" / "cluster-local.yaml"
    with BenchPlatform("api,scheduler,lcm", [f"--cluster-config={cluster}"]) as platform:
        record, out = run_under_trace(
            platform,
            manifest,
            code,
            progress,
            trace=a.trace,
            time_scale=a.time_scale,
            notice=a.notice,
            seed=a.seed,
            injector_args=["--start", str(a.start)],
            start_timeout_s=180,
            end_timeout_s=a.timeout,
        )
    if record.status != "COMPLETED":
        lines = "\n".join(record.last_log_lines or [])
        story = "\n".join(f"{h.status}: {h.message}" for h in record.history)
        raise SystemExit(
            f"the job ended {record.status}: {record.status_message}\n{lines}\n{story}"
        )
    rows = [json.loads(line) for line in progress.read_text().splitlines()]
    history = [(h.time, h.status, h.message) for h in record.history]
    return {"rows": rows, "history": history, "injections": json.loads(out or "[]")}


def _step_rows(rows: list[dict[str, Any]]) -> list[tuple[float, int, int, int]]:
    """(time, epoch, step, generation) of every step line in time order; the epoch grows
    at each restart from the checkpoint (the generation starts again at 0)."""
    parsed = []
    for r in rows:
        parts = r["line"].split()
        parsed.append((float(r["t"]), int(parts[1]), int(parts[parts.index("generation") + 1])))
    parsed.sort()
    out, epoch, last_gen = [], 0, -1
    for t, step, gen in parsed:
        if gen < last_gen:
            epoch += 1
        last_gen = gen
        out.append((t, epoch, step, gen))
    return out


def _generations(history: list[tuple[float, str, str]]) -> dict[str, Any]:
    """From the job's history: per epoch, the failover generations and the join
    generations, and the seconds from each loss's failover note to its join note."""
    failovers: set[tuple[int, int]] = set()
    joins: set[tuple[int, int]] = set()
    epoch, restarts = 0, 0
    pending: list[float] = []
    loss_to_join: list[float] = []
    for t, status, message in history:
        if status == "RECOVERING":
            epoch += 1
            restarts += 1
            pending.clear()
            continue
        if "(generation " not in message:
            continue
        gen = int(message.rsplit("(generation ", 1)[1].rstrip(")"))
        if " preempted" in message and "now served by" in message:
            failovers.add((epoch, gen))
            pending.append(t)
        elif "every block has a replica" in message:
            joins.add((epoch, gen))
            if pending:
                loss_to_join.append(t - pending.pop(0))
    return {
        "failovers": failovers,
        "joins": joins,
        "restarts": restarts,
        "loss_to_join_s": loss_to_join,
    }


def summarise(run: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    steps = _step_rows(run["rows"])
    gens = _generations(run["history"])
    gaps = [
        (b[0] - x[0], b[1], b[3], b[1] == x[1] and b[3] != x[3])
        for x, b in itertools.pairwise(steps)
    ]
    # steady: consecutive steps of one generation that is no failover generation
    steady = [g for g, ep, gen, new in gaps if not new and (ep, gen) not in gens["failovers"]]
    step_s = statistics.median(steady)
    degraded = [g for g, ep, gen, new in gaps if not new and (ep, gen) in gens["failovers"]]
    first_of = {(ep, gen): g for g, ep, gen, new in gaps if new}
    failover_pauses = [max(0.0, first_of[k] - step_s) for k in gens["failovers"] if k in first_of]
    join_pauses = [max(0.0, first_of[k] - step_s) for k in gens["joins"] if k in first_of]
    total = steps[-1][0] - steps[0][0] + step_s  # the first step's own time included
    # a restart from the checkpoint: from the RECOVERING entry to the next step line
    # (every learner started again, links built, blocks loaded)
    recovering = [t for t, status, _ in run["history"] if status == "RECOVERING"]
    restart_gaps = []
    for t_r in recovering:
        after = [row[0] for row in steps if row[0] > t_r]
        if after:
            restart_gaps.append(after[0] - t_r)
    return {
        "time_s": total,
        "training_share": a.steps * step_s / total,
        "failovers": len(gens["failovers"]),
        "restarts": gens["restarts"],
        "hits": len(run["injections"]),
        "delivered": sum(1 for i in run["injections"] if i.get("outcome") != "missed"),
        # the simulator's inputs, measured here
        "step_s": step_s,
        "degraded_slowdown": (statistics.median(degraded) / step_s) if degraded else 1.0,
        "failover_s": statistics.median(failover_pauses) if failover_pauses else 0.0,
        "reconfig_s": statistics.median(join_pauses) if join_pauses else 0.0,
        "join_s": statistics.median(gens["loss_to_join_s"]) if gens["loss_to_join_s"] else 0.0,
        "restart_s": statistics.median(restart_gaps) if restart_gaps else 0.0,
    }


def simulate(
    a: argparse.Namespace, hits: list[float], real: dict[str, Any], new_nodes_s: float
) -> dict[str, Any]:
    """The `redundant` strategy with the platform's measured figures, on exactly the hits
    the injector drew (each the job's), from a job running at time 0. `new_nodes_s`: the
    simulator's one figure for both a replacement's arrival and a restart after a fatal
    loss (its allocation); the platform's two differ, so main runs it with each."""
    events = [TraceEvent(t, "remove", "n") for t in hits] + [TraceEvent(1e7, "add", "n")]
    model = PreemptionModel(
        notice_s=a.notice, trace=Trace("p3-slice", tuple(events)), random_offset=False
    )
    job = JobSpec(
        name="pipeline-trace",
        steps=a.steps,
        step_s=real["step_s"],
        save_s=0.0,
        backup_s=0.0,
        alloc_s=(new_nodes_s, new_nodes_s),
        prep_s=(0.0, 0.0),
        stages=2,
        pipelines=1,
    )
    params = RedundancyParams(
        overhead=0.0,  # the measured step time already holds the redundant computation
        failover_s=real["failover_s"],
        reconfig_s=real["reconfig_s"],
        degraded_slowdown=max(1.0, real["degraded_slowdown"]),
        checkpoint_every_s=10 * real["step_s"],  # the runtime's block checkpoint
    )
    result = Sim(job, model, Redundant(params), Prices(3.06, 0.918), seed=a.seed).run()
    return {
        "time_s": result.time_s,
        "training_share": result.breakdown["compute"] / result.time_s,
        "failovers": result.failovers,
        "restarts": result.fatal_failures,
        "hits": result.preemptions,
        "delivered": float("nan"),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--trace", default="aws-p3-64.csv")
    p.add_argument("--time-scale", type=float, default=200.0)
    p.add_argument("--start", type=float, default=0.0, help="trace seconds to start at")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--step-sleep", type=float, default=0.2)
    p.add_argument("--notice", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=1500.0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    a = p.parse_args()
    # two learners: the same seeded hits the injector draws for the job (`--job`)
    hits = trace_schedule(
        a.trace, time_scale=a.time_scale, start_s=a.start, job_nodes=2, seed=a.seed
    )
    print(f"{len(hits)} hits on the job in the scaled trace slice", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="pipeline-trace-") as tmp:
        real = summarise(platform_run(a, Path(tmp)), a)
    sim = simulate(a, hits, real, real["join_s"])
    sim_r = simulate(a, hits, real, real["restart_s"] or real["join_s"])
    if a.json:
        print(json.dumps({"platform": real, "simulator": sim, "simulator_restart": sim_r}))
        return
    print(
        f"\ntrace {a.trace} from {a.start:g} s, / {a.time_scale:g}, seed {a.seed}; "
        f"{a.steps} steps, 2 stages x 1 pipeline"
    )
    print(
        "simulator inputs measured in this run: "
        f"step {real['step_s']:.3f} s, failover pause {real['failover_s']:.2f} s, "
        f"reconfiguration pause {real['reconfig_s']:.2f} s, degraded slowdown "
        f"{real['degraded_slowdown']:.2f}x, loss -> replacement joined {real['join_s']:.1f} s, "
        f"block checkpoint every {10 * real['step_s']:.1f} s; restart from the checkpoint "
        f"-> training again {real['restart_s']:.1f} s"
    )
    print(
        "simulator A: new nodes arrive in the replacement's join time; "
        "simulator B: in the checkpoint restart's time"
    )
    print("| figure | platform | simulator A | platform / A | simulator B | platform / B |")
    print("| --- | --- | --- | --- | --- | --- |")
    for key, label, fmt in (
        ("time_s", "time to finish (s)", "{:.1f}"),
        ("training_share", "share of time on new steps", "{:.1%}"),
        ("failovers", "failovers (runtime took over a lost stage)", "{:.0f}"),
        ("restarts", "restarts from the checkpoint (stage and shadow lost)", "{:.0f}"),
        ("hits", "trace hits before the job ended", "{:.0f}"),
        ("delivered", "of which found a learner running", "{:.0f}"),
    ):
        x = real[key]
        cells = []
        for y in (sim[key], sim_r[key]):
            cells.append(fmt.format(y) if y == y else "-")
            cells.append(f"{x / y:.2f}" if y == y and y else "-")
        print(f"| {label} | {fmt.format(x)} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
