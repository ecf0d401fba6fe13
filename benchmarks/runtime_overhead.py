"""Redundant-computation overhead and failover pause of the pipeline runtime (Bamboo Table 4, Fig. 13).

    .venv/bin/python benchmarks/runtime_overhead.py [--steps 12] [--reps 3] [--modes ...]

Runs 2 stages x 1 pipeline through ``learner.runtime.launch`` (one process per stage,
one torch thread per process, gloo on CPU) for a transformer (the char GPT of
examples/pipeline-gpt, 4 blocks of width 128) and a small ResNet-style CNN (GroupNorm,
32x32 inputs), and prints:

- per-iteration time of each redundancy mode relative to ``none``, measured in the
  same launcher run, modes interleaved and repeated to spread machine noise;
- the failover pause: stage 1 SIGKILLs itself at three points of a step (early in its
  backwards, before its last forward, with the all-reduce pending); stage 0 promotes its
  replica and finishes the step. The pause is what the failure adds to that step —
  its duration minus the median iteration before the failure (detection, rendezvous,
  lazy BRC of the lost microbatches, the victim's remaining work on one process) —
  divided by that iteration. The step's whole duration over an iteration is printed too.

All modes of one model run inside the same two worker processes one after the other
(each run with its own etcd job id and store prefix), so process start-up is paid once.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _pipeline_models import issue24_gpt_job  # noqa: E402

from learner.runtime.api import PipelineJob, RedundancyMode  # noqa: E402

MODES = [m.value for m in RedundancyMode]
# where stage 1 SIGKILLs itself in the failover runs: early in the step's backwards, at
# its last forward, and after its compute (all-reduce pending)
KILLS = ["backward:1", "forward:3", "allreduce"]
BAMBOO_EAGER_FRC_LAZY_BRC = {"transformer": 0.198, "cnn": 0.095}
PAPER = {  # Bamboo Table 4, per-iteration overhead vs no redundancy
    "transformer": {
        "eager-frc-lazy-brc": "19.8 % (BERT)",
        "lazy-frc-lazy-brc": "7 %",
        "eager-frc-eager-brc": "64-72 %",
    },
    "cnn": {
        "eager-frc-lazy-brc": "9.5 % (ResNet)",
        "lazy-frc-lazy-brc": "7 %",
        "eager-frc-eager-brc": "64-72 %",
    },
}


class ResBlock(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(ch, ch, 3, padding=1),
            nn.GroupNorm(8, ch),
            nn.ReLU(),
            nn.Conv2d(ch, ch, 3, padding=1),
            nn.GroupNorm(8, ch),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


def cnn_job(steps: int, redundancy: str) -> PipelineJob:
    ch = 32

    def build() -> list[nn.Module]:
        return [
            nn.Sequential(nn.Conv2d(3, ch, 3, padding=1), nn.GroupNorm(8, ch), nn.ReLU()),
            *[ResBlock(ch) for _ in range(4)],
            nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(ch, 10)),
        ]

    def batch(step: int, pipe: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step * 1000 + pipe * 100 + m)
        return torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)

    return PipelineJob(
        build_layers=build,
        batch=batch,
        loss_fn=nn.functional.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        steps=steps,
        microbatches=4,
        redundancy=RedundancyMode.parse(redundancy),
    )


def transformer_job(steps: int, redundancy: str) -> PipelineJob:
    return issue24_gpt_job(steps, redundancy)


JOBS = {"transformer": transformer_job, "cnn": cnn_job}


# ----------------------------------------------------------------- worker side


def worker_main(args: argparse.Namespace) -> None:
    """Runs inside each launched worker process."""
    from datetime import timedelta

    import torch.distributed as dist

    from contract.env import RuntimeEnv
    from learner.runtime.cluster_state import EtcdClusterStateStore
    from learner.runtime.engine import Worker
    from learner.runtime.worker import options_from_env

    torch.set_num_threads(1)
    env = RuntimeEnv.from_environ(os.environ)
    opts = options_from_env(env)
    opts.verbose = args.phase == "failover"
    host, _, port = env.store.rpartition(":")
    store = dist.TCPStore(host, int(port), None, False, timeout=timedelta(seconds=60))
    runs = []
    if args.phase == "overhead":
        for rep in range(args.reps):
            for mode in args.modes.split(","):
                runs.append((args.model, mode, rep))
    else:
        runs.append((args.model, RedundancyMode.EAGER_FRC_LAZY_BRC.value, 0))
    code = 0
    for i, (model, mode, rep) in enumerate(runs):
        job = JOBS[model](args.steps, mode)
        cluster = EtcdClusterStateStore(env.etcd, f"{env.job_id}-{i}")
        worker = Worker(job, opts, cluster, dist.PrefixStore(f"run{i}", store))
        try:
            worker.run()
        except Exception as exc:
            print(f"ERROR {exc!r}", file=sys.stderr, flush=True)
            code = 1
            break
        finally:
            cluster.close()
        # two processes share stdout: results go to one file each
        with open(Path(args.results) / f"w{worker.me}-run{i}.json", "w") as fh:
            fh.write(
                json.dumps(
                    {
                        "worker": worker.me,
                        "model": model,
                        "mode": mode,
                        "rep": rep,
                        "times": [t for _, t in worker.step_times],
                        "owned": sorted(worker.owned),
                    }
                )
            )
    sys.stdout.flush()
    os._exit(code)


# ------------------------------------------------------------------ driver side


def launch(
    etcd: str, phase: str, model: str, steps: int, reps: int, modes: str, kill: str = ""
) -> list[dict[str, object]]:
    results = Path(tempfile.mkdtemp(prefix="runtime-bench-"))
    argv = [
        sys.executable,
        "-m",
        "learner.runtime.launch",
        "--stages",
        "2",
        "--pipelines",
        "1",
        "--etcd",
        etcd,
        "--detection-timeout",
        "10",
    ]
    if kill:
        argv += ["--kill", kill]
    argv += [
        __file__,
        "--worker",
        "--phase",
        phase,
        "--model",
        model,
        "--steps",
        str(steps),
        "--reps",
        str(reps),
        "--modes",
        modes,
        "--results",
        str(results),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{phase} run of {model} failed:\n{proc.stderr[-4000:]}")
    out = [json.loads(f.read_text()) for f in sorted(results.glob("*.json"))]
    shutil.rmtree(results, ignore_errors=True)
    if phase == "failover":
        m = re.search(r"joined generation 1 in ([\d.]+) s", proc.stderr)
        for rec in out:
            rec["join_s"] = float(m.group(1)) if m else float("nan")
    return out


def driver(args: argparse.Namespace) -> None:
    from learner.runtime.launch import private_etcd

    warm = 3
    print(
        f"# runtime_overhead: 2 stages x 1 pipeline, gloo/CPU, 1 torch thread per process, "
        f"{os.cpu_count()} cores; {args.steps} steps per run (first {warm} dropped), "
        f"{args.reps} interleaved repetitions"
    )
    print(
        "# CPU note: more processes than cores would fill the bubble with other stages' work;"
        " here 2 processes share 2 cores with whatever else runs on the machine."
    )
    rows = []
    fail_rows = []
    with private_etcd() as etcd:
        for model in args.models.split(","):
            recs = launch(etcd, "overhead", model, args.steps, args.reps, args.modes)
            per_mode: dict[str, list[float]] = {}
            for rec in recs:
                if rec["worker"] != 1:  # one timing per run: the last stage's
                    continue
                times = rec["times"][warm:]  # type: ignore[index]
                per_mode.setdefault(str(rec["mode"]), []).append(statistics.median(times))
            base = statistics.median(per_mode["none"])
            for mode in args.modes.split(","):
                t = statistics.median(per_mode[mode])
                rows.append((model, mode, t, t / base - 1.0, PAPER[model].get(mode, "-")))
            kill_step = args.steps // 2
            for where in [] if args.only_overhead else KILLS:
                frecs = launch(
                    etcd,
                    "failover",
                    model,
                    args.steps,
                    1,
                    args.modes,
                    kill=f"1:{kill_step}:{where}",
                )
                rec = next(r for r in frecs if r["worker"] == 0)
                times = rec["times"]  # type: ignore[assignment]
                before = statistics.median(times[warm:kill_step])  # type: ignore[index]
                after = statistics.median(times[kill_step + 1 :])  # type: ignore[index]
                step = times[kill_step]  # type: ignore[index]
                fail_rows.append(
                    (
                        model,
                        where,
                        before,
                        step,
                        (step - before) / before,
                        float(rec["join_s"]),  # type: ignore[arg-type]
                        after / before,
                    )
                )
    print()
    print("| model | mode | iteration (s) | overhead vs none | Bamboo Table 4 |")
    print("| --- | --- | ---: | ---: | --- |")
    for model, mode, t, ov, paper in rows:
        print(f"| {model} | {mode} | {t:.4f} | {ov * 100:+.1f} % | {paper} |")
    print()
    print(
        "| model | stage 1 killed before | iteration before (s) | failover step (s) "
        "| step / iteration | pause / iteration | rejoin (s) | iteration after / before |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model, where, before, step, pause, join, after in fail_rows:
        print(
            f"| {model} | {where} | {before:.4f} | {step:.4f} | {step / before:.2f} "
            f"| {pause:.2f} | {join:.3f} | {after:.2f} |"
        )
    print()
    worst = max((r[4] for r in fail_rows), default=float("nan"))
    print(
        f"goal: failover pause < 1 iteration: worst {worst:.2f} -> "
        + ("met" if worst < 1.0 else "NOT met")
    )
    if "eager-frc-lazy-brc" in args.modes.split(","):
        for model, mode, _, ov, _ in rows:
            if mode == "eager-frc-lazy-brc":
                goal = BAMBOO_EAGER_FRC_LAZY_BRC[model]
                print(
                    f"goal: {model} eager-frc-lazy-brc overhead below Bamboo's {goal * 100:.1f} %: "
                    f"{ov * 100:+.1f} % -> " + ("met" if ov < goal else "NOT met")
                )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated redundancy modes to time (must include none)",
    )
    p.add_argument("--models", default=",".join(JOBS), help="comma-separated: transformer,cnn")
    p.add_argument("--only-overhead", action="store_true", help="skip the failover runs")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--phase", default="overhead", help=argparse.SUPPRESS)
    p.add_argument("--model", default="transformer", help=argparse.SUPPRESS)
    p.add_argument("--results", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker_main(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
