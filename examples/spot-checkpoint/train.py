"""A small real training script using the Rhizome checkpoint SDK.

It trains a linear regression with SGD on batches generated from (seed, step), so a run
that is preempted and resumed ends with exactly the parameters of one that was not.
Each completed step is appended to `--progress` as a JSON line, which is how the tests
count lost steps. Runs bare too: without RHIZOME_* variables the SDK is a no-op twin.

    python examples/spot-checkpoint/train.py --steps 50 --progress /tmp/progress.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import learner.sdk as rz


def batch(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(32, 8, generator=gen)
    y = x @ torch.arange(1.0, 9.0).unsqueeze(1) + 0.1 * torch.randn(32, 1, generator=gen)
    return x, y


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="total training steps")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument(
        "--save-sleep", type=float, default=0.0, help="extra seconds per save (a big model)"
    )
    parser.add_argument("--save-every", type=int, default=0, help="own periodic save (0: none)")
    parser.add_argument("--progress", type=Path, required=True, help="JSON-lines step log")
    parser.add_argument("--final", type=Path, help="where to write the final parameters")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    model = torch.nn.Linear(8, 1)
    torch.manual_seed(args.seed)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    start = 0
    ckpt = rz.latest_checkpoint()
    if ckpt is not None:
        state = torch.load(ckpt.path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
    progress = open(args.progress, "a", buffering=1)  # noqa: SIM115 - lives for the run
    progress.write(json.dumps({"event": "start", "from": start, "t": time.time()}) + "\n")

    for i in range(start, args.steps):
        with rz.step():
            x, y = batch(args.seed, i)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)
        progress.write(json.dumps({"step": i + 1, "t": time.time(), "loss": loss.item()}) + "\n")
        periodic = args.save_every > 0 and (i + 1) % args.save_every == 0
        if periodic or rz.should_save():
            path = rz.staging_path("model.pt")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": i + 1}, path)
            if args.save_sleep:
                time.sleep(args.save_sleep)
            rz.backup(path, step=i + 1)

    rz.close()
    if args.final:
        torch.save(model.state_dict(), args.final)
    progress.write(json.dumps({"event": "done", "t": time.time()}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
