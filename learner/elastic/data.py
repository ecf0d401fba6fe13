"""The dynamic data pipeline: an epoch's samples cut into blocks handed out on demand,
exactly once.

The plan is a pure value. Every worker holds the same copy and computes each step's
assignment with `assign(members)` (deterministic, so no etcd round trip per hand-out);
it becomes the next plan only when the step's all-reduce completed (`commit`), so the
samples of a step that failed (a worker died mid-batch) stay assigned and are redone.
At a re-form every worker takes the plan of the worker with the most steps done, and
`reassign(members)` returns the unfinished ranges of departed workers to the pool, which
hands them out again before any fresh block. Positions index a per-epoch permutation of
the data set (`sample_ids`); the leader keeps a copy in etcd, a checkpoint another.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

Range = tuple[int, int]  # [start, end) positions in the epoch's order


@dataclass(frozen=True)
class DataPlan:
    num_samples: int
    batch_size: int
    block_size: int
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    next_block: int = 0
    returned: tuple[Range, ...] = ()
    cursors: dict[str, Range] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("num_samples", "batch_size", "block_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"data plan: {name} must be a positive integer")

    @property
    def num_blocks(self) -> int:
        return -(-self.num_samples // self.block_size)

    def sample_ids(self) -> list[int]:
        """Position -> sample index for this epoch (a seeded permutation, or identity)."""
        ids = list(range(self.num_samples))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(ids)
        return ids

    def assign(self, members: list[str]) -> tuple[DataPlan, dict[str, Range | None]]:
        """Each member's mini-batch of the next step (None: nothing left for it) and the
        plan once that step completes. Members draw in rank order; a worker whose block
        runs out gets the next returned range, else the next fresh block. A batch comes
        from one range, so it is contiguous positions (a short batch at a range's end)."""
        cursors = dict(self.cursors)
        returned = list(self.returned)
        next_block = self.next_block
        out: dict[str, Range | None] = {}
        for worker in members:
            start, end = cursors.get(worker, (0, 0))
            if start >= end:
                if returned:
                    start, end = returned.pop(0)
                elif next_block < self.num_blocks:
                    start = next_block * self.block_size
                    end = min(start + self.block_size, self.num_samples)
                    next_block += 1
                else:
                    cursors.pop(worker, None)
                    out[worker] = None
                    continue
            stop = min(start + self.batch_size, end)
            out[worker] = (start, stop)
            cursors[worker] = (stop, end)
        plan = dataclasses.replace(
            self, cursors=cursors, returned=tuple(returned), next_block=next_block
        )
        return plan, out

    def exhausted(self) -> bool:
        """Every sample of the epoch is used (no cursor, returned range or fresh block)."""
        return (
            self.next_block >= self.num_blocks
            and not self.returned
            and all(s >= e for s, e in self.cursors.values())
        )

    def next_epoch(self) -> DataPlan:
        return dataclasses.replace(
            self, epoch=self.epoch + 1, next_block=0, returned=(), cursors={}
        )

    def reassign(self, members: list[str]) -> DataPlan:
        """The plan for a new membership: the unfinished ranges of workers that left or
        died go back to the pool (in rank order of their former holders' names)."""
        keep = {w: r for w, r in self.cursors.items() if w in members}
        gone = [r for w, r in sorted(self.cursors.items()) if w not in members and r[0] < r[1]]
        return dataclasses.replace(self, cursors=keep, returned=(*self.returned, *gone))

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["returned"] = [list(r) for r in self.returned]
        data["cursors"] = {w: list(r) for w, r in self.cursors.items()}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DataPlan:
        try:
            return cls(
                num_samples=int(data["num_samples"]),
                batch_size=int(data["batch_size"]),
                block_size=int(data["block_size"]),
                seed=int(data["seed"]),
                shuffle=bool(data["shuffle"]),
                epoch=int(data["epoch"]),
                next_block=int(data["next_block"]),
                returned=tuple((int(a), int(b)) for a, b in data["returned"]),
                cursors={str(w): (int(r[0]), int(r[1])) for w, r in data["cursors"].items()},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"not a data plan ({exc}); was it written by learner/elastic?"
            ) from exc


def choose_source(steps: dict[str, int]) -> str:
    """The worker whose state everyone takes at a re-form: the most steps done (a worker
    that finished the last all-reduce before a peer died is ahead of one that did not),
    ties to the lowest name so every worker picks the same one."""
    if not steps:
        raise ValueError("no worker to take the state from")
    return min(steps, key=lambda w: (-steps[w], w))
