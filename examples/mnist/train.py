"""A small CNN on scikit-learn's bundled handwritten digits (1,797 8x8 images, offline).

Runs bare (`python examples/mnist/train.py`) or as a Rhizome learner; prints progress
each epoch and the final test accuracy, and writes it to $RHIZOME_RESULT_DIR when set.
Single-threaded on purpose: the machines we demo on are small and shared.

It checkpoints through the Rhizome SDK (`learner.sdk`) after every epoch, so a job that is
halted (or preempted) and resumed continues from the last finished epoch; each epoch's
shuffle is drawn from (seed, epoch), so the resumed run trains exactly as an unbroken one.
Bare, the SDK is a no-op and nothing is saved.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import learner.sdk as rz


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        list(range(len(y))), test_size=0.2, random_state=args.seed, stratify=digits.target
    )
    x_train, y_train, x_test, y_test = x[train_idx], y[train_idx], x[test_idx], y[test_idx]
    print(f"digits: {len(y_train)} train / {len(y_test)} test images, 10 classes", flush=True)
    model = SmallCNN()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    done = 0  # epochs finished, by this run or the one a checkpoint came from
    ckpt = rz.latest_checkpoint()
    if ckpt is not None:
        state = torch.load(ckpt.path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        done = int(state["epoch"])
        print(f"resuming from the checkpoint of epoch {done}/{args.epochs}", flush=True)
    start = time.time()
    accuracy = 0.0
    for epoch in range(done + 1, args.epochs + 1):
        model.train()
        perm = torch.randperm(
            len(y_train), generator=torch.Generator().manual_seed(args.seed * 1_000_003 + epoch)
        )
        total = 0.0
        for i in range(0, len(perm), args.batch_size):
            with rz.step():  # a preemption notice is acted on between steps
                batch = perm[i : i + args.batch_size]
                opt.zero_grad()
                loss = loss_fn(model(x_train[batch]), y_train[batch])
                loss.backward()
                opt.step()
                total += float(loss.detach()) * len(batch)
        model.eval()
        with torch.no_grad():
            accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
        print(
            f"epoch {epoch}/{args.epochs} loss={total / len(y_train):.4f} "
            f"test_accuracy={accuracy:.4f} ({time.time() - start:.1f}s)",
            flush=True,
        )
        # Every epoch: a halt or preemption loses at most the epoch under way. On a
        # preemption notice this save is the emergency one, after which the SDK exits.
        path = rz.staging_path("mnist.pt")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch}, path)
        rz.backup(path, step=epoch)
    rz.close()
    if done >= args.epochs:  # resumed after the last epoch: report the checkpoint's model
        model.eval()
        with torch.no_grad():
            accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
    print(f"final test accuracy: {accuracy:.4f}", flush=True)
    result_dir = os.environ.get("RHIZOME_RESULT_DIR")
    if result_dir:
        Path(result_dir).mkdir(parents=True, exist_ok=True)
        (Path(result_dir) / "metrics.json").write_text(json.dumps({"test_accuracy": accuracy}))
        torch.save(model.state_dict(), Path(result_dir) / "model.pt")


if __name__ == "__main__":
    main()
