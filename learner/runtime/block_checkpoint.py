"""Block checkpoints: what a job restarts from after a fatal loss (a stage and its shadow).

Every ``every`` steps, at the step boundary, each worker saves the blocks it owns —
parameters, optimizer state and version — as ``block<b>-step<s>.pt`` in the job's
checkpoint directory (written to a temporary name, then renamed: a reader never sees
half a file). After an all-reduce every pipeline's copy of a block is identical, so a
file written by any owner is the block. A step is *complete* when every block has a
file for it; a restarted worker loads its owned block and its replica from the latest
complete step and starts there. Because the state is exact and batches are a function
of the step, the restarted run ends with the parameters of an uninterrupted one.

The step count is fixed for the job (not a time interval): workers decide the same
steps without talking, and a complete step always exists after the first save.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from learner.runtime.worker_state import BlockState

_NAME = re.compile(r"^block(\d+)-step(\d+)\.pt$")


def _path(directory: Path, block: int, step: int) -> Path:
    return directory / f"block{block}-step{step}.pt"


def save(directory: str, blocks: list[BlockState], step: int, keep: int = 2) -> None:
    """Save ``blocks`` at ``step`` (their version); keep the ``keep`` latest steps."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for blk in blocks:
        final = _path(out, blk.index, step)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        torch.save(
            {
                "module": blk.module.state_dict(),
                "optimizer": blk.optimizer.state_dict(),
                "version": blk.version,
            },
            tmp,
        )
        os.replace(tmp, final)
        # Older saves go, the newest `keep` stay: when one worker saves step s, every
        # other has saved the previous save step, so a complete step always remains.
        saved = sorted(
            (int(m.group(2)), p)
            for p in out.glob(f"block{blk.index}-step*.pt")
            if (m := _NAME.match(p.name))
        )
        for _, old in saved[:-keep]:
            old.unlink(missing_ok=True)


def latest_complete(directory: str | None, blocks: int) -> int | None:
    """The latest step every one of ``blocks`` blocks was saved at, or None."""
    if not directory or not Path(directory).is_dir():
        return None
    steps: dict[int, set[int]] = {}
    for p in Path(directory).iterdir():
        m = _NAME.match(p.name)
        if m:
            steps.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    complete = [s for s, got in steps.items() if got >= set(range(blocks))]
    return max(complete) if complete else None


def load(directory: str, blk: BlockState, step: int) -> None:
    """Load ``blk`` as it was saved at ``step`` (exact)."""
    got = torch.load(_path(Path(directory), blk.index, step), weights_only=True)
    blk.module.load_state_dict(got["module"])
    blk.optimizer.load_state_dict(got["optimizer"])
    blk.version = int(got["version"])
    blk.snapshot = None
    blk.drop_prepared()
