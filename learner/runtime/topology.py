"""Who holds which layers in a configuration: owners, replicas, links, all-reduce groups.

Worker ``w`` starts as stage ``w % P`` of pipeline ``w // P`` and owns block ``w % P``;
its replica is block ``(w + 1) % P`` of the same pipeline (the last stage holds block 0).
When a worker dies its shadow (the predecessor, which holds the replica) owns the block
too. Everything here is a pure function of ``(P, D, dead)`` so every worker computes
the same configuration without talking to anyone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


def worker_of(pipeline: int, stage: int, stages: int) -> int:
    return pipeline * stages + stage


@dataclass(frozen=True)
class Topology:
    stages: int
    pipelines: int
    dead: frozenset[int] = field(default_factory=frozenset)
    redundancy: bool = True

    @property
    def workers(self) -> list[int]:
        return list(range(self.stages * self.pipelines))

    @property
    def alive(self) -> list[int]:
        return [w for w in self.workers if w not in self.dead]

    def pipeline_of(self, worker: int) -> int:
        return worker // self.stages

    def fatal_reason(self) -> str | None:
        """A one-line reason when some block has no live holder, else None."""
        return self.fatal_info()[0]

    def fatal_info(self) -> tuple[str | None, int, tuple[int, ...]]:
        """(reason, pipeline, lost stages) of the first unrecoverable loss, or (None, -1, ())."""
        for d in range(self.pipelines):
            lost = [s for s in range(self.stages) if worker_of(d, s, self.stages) in self.dead]
            for s in lost:
                shadow_stage = (s - 1) % self.stages
                shadow = worker_of(d, shadow_stage, self.stages)
                if not self.redundancy:
                    return (
                        f"pipeline {d} lost stage {s} (worker {worker_of(d, s, self.stages)}) "
                        "and redundancy is 'none': restart from the latest checkpoint",
                        d,
                        (s,),
                    )
                if self.stages == 1 or shadow in self.dead:
                    pair = sorted({shadow_stage, s})
                    names = " and ".join(str(x) for x in pair)
                    return (
                        f"pipeline {d} lost consecutive stages {names} "
                        f"(workers {', '.join(str(worker_of(d, x, self.stages)) for x in pair)}): "
                        "no replica left; restart from the latest checkpoint",
                        d,
                        tuple(pair),
                    )
        return None, -1, ()

    def owner(self, pipeline: int, block: int) -> int:
        w = worker_of(pipeline, block, self.stages)
        if w not in self.dead:
            return w
        shadow = worker_of(pipeline, (block - 1) % self.stages, self.stages)
        if shadow in self.dead or not self.redundancy:
            raise LookupError(f"block {block} of pipeline {pipeline} has no live holder")
        return shadow

    def owned_blocks(self, worker: int) -> list[int]:
        d = self.pipeline_of(worker)
        return [b for b in range(self.stages) if self.owner(d, b) == worker]

    def replica_block(self, worker: int) -> int | None:
        """The block ``worker`` holds as a replica, or None (no redundancy, or promoted)."""
        if not self.redundancy or self.stages == 1 or worker in self.dead:
            return None
        d = self.pipeline_of(worker)
        block = (worker % self.stages + 1) % self.stages
        if self.owner(d, block) == worker:
            return None
        return block

    def replica_holder(self, pipeline: int, block: int) -> int | None:
        holder = worker_of(pipeline, (block - 1) % self.stages, self.stages)
        if holder in self.dead or self.replica_block(holder) != block:
            return None
        return holder

    def peers(self, worker: int) -> list[int]:
        """Workers this one exchanges point-to-point messages with in this configuration."""
        d = self.pipeline_of(worker)
        mine = set(self.owned_blocks(worker))
        rep = self.replica_block(worker)
        out: set[int] = set()
        for b in mine:
            for nb in ((b - 1) % self.stages, (b + 1) % self.stages):
                out.add(self.owner(d, nb))
            holder = self.replica_holder(d, b)
            if holder is not None:
                out.add(holder)
        if rep is not None:
            out.add(self.owner(d, rep))
        out.discard(worker)
        return sorted(out)

    def group(self, block: int) -> list[int]:
        """Owners of ``block`` across pipelines, in pipeline order (the all-reduce group)."""
        return [self.owner(d, block) for d in range(self.pipelines)]

    def with_dead(self, workers: Iterable[int]) -> Topology:
        return Topology(
            self.stages, self.pipelines, self.dead | frozenset(workers), self.redundancy
        )
