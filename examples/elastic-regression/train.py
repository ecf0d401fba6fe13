"""An elastic data-parallel training script: start as many copies as you like, at any
time, with the same --job and --etcd; stop any of them (SIGTERM leaves at the next
mini-batch boundary, SIGKILL is survived). A linear regression on a fixed synthetic data
set, so that runs are reproducible (the tests compare the result to a single-process
replay of the same sample order). See docs/elastic.md.

    python examples/elastic-regression/train.py --job demo --etcd http://127.0.0.1:2379
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from learner import elastic


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 1)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def make_dataset(size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(size, 8, generator=gen)
    y = x @ torch.arange(1.0, 9.0).unsqueeze(1) + 0.1 * torch.randn(size, 1, generator=gen)
    return [(x[i], y[i]) for i in range(size)]


def save_checkpoint(path: Path, job: elastic.ElasticJob) -> None:
    """Save the job's state (which continues the epoch) unless a worker that left later,
    with more steps, already saved: workers stopped together leave at nearby steps."""
    if path.exists() and torch.load(path, weights_only=False)["step"] > job.step_count:
        return
    tmp = path.with_name(f"{path.name}.{job.name}.tmp")
    torch.save(job.state_dict(), tmp)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # On the platform both come from the learner's environment (RHIZOME_JOB_ID and
    # RHIZOME_ELASTIC_ETCD, contract/env.py), which `elastic.join` reads by itself.
    parser.add_argument("--job", default=None, help="job id (default: RHIZOME_JOB_ID)")
    parser.add_argument("--etcd", default=None, help="etcd URL (default: RHIZOME_ELASTIC_ETCD)")
    parser.add_argument("--worker", default=None, help="worker name (default: random)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument(
        "--step-delay", type=float, default=0.0, help="seconds of extra work per batch"
    )
    parser.add_argument(
        "--leave-at", type=int, default=0, help="leave gracefully after this step (0: never)"
    )
    parser.add_argument("--straggler-window", type=int, default=0)
    parser.add_argument("--sample-log", default=None, help="JSON lines of every committed step")
    parser.add_argument(
        "--out", default=None, help="directory for <worker>.json: final step, parameters"
    )
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="resume from this file if it exists; save to it on leaving",
    )
    parser.add_argument("--verbose", action="store_true", help="log every re-form's plan")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(message)s",
    )

    # everything is built before joining, while the others keep training
    model = make_model()
    optimizer = make_optimizer(model)
    dataset = make_dataset(args.samples)
    resume = None
    if args.checkpoint and Path(args.checkpoint).exists():
        resume = torch.load(args.checkpoint, weights_only=False)
    try:
        job = elastic.join(
            model,
            optimizer,
            dataset,
            batch_size=args.batch_size,
            etcd=args.etcd,
            job_id=args.job,
            worker=args.worker,
            block_size=args.block_size,
            min_workers=args.min_workers,
            sample_log=args.sample_log,
            straggler_window=args.straggler_window,
            resume=resume,
        )
    except elastic.ElasticError as exc:
        print(f"train.py: {exc}", file=sys.stderr)
        return 2
    print(
        f"joined generation {job.generation} at step {job.step_count} as one of {len(job.members)}",
        flush=True,
    )
    try:
        for x, y in job.batches(epochs=args.epochs):
            if args.step_delay:
                time.sleep(args.step_delay)  # stands in for a bigger model's compute
            job.step(F.mse_loss(model(x), y))
            if job.step_count % 20 == 0:
                print(
                    f"step {job.step_count} epoch {job.epoch} workers {len(job.members)}",
                    flush=True,
                )
            if args.leave_at and job.step_count >= args.leave_at:
                job.leave(f"asked to leave at step {args.leave_at}")
    except elastic.RemovedFromJob as exc:
        print(f"train.py: {exc}", file=sys.stderr)
        return 3
    print(f"done at step {job.step_count} epoch {job.epoch}", flush=True)
    if args.out:
        out = Path(args.out) / f"{job.name}.json"
        params = {k: v.tolist() for k, v in model.state_dict().items()}
        out.write_text(
            json.dumps(
                {
                    "step": job.step_count,
                    "epoch": job.epoch,
                    "params": params,
                    "stalls": getattr(job, "stalls", []),
                }
            )
        )
    if args.checkpoint:
        save_checkpoint(Path(args.checkpoint), job)
    job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
