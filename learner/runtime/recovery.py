"""The rest of an interrupted step, planned from what the survivors still hold.

After a failover every survivor of a pipeline reports, per block and for the step being
resumed, what it still has (``BlockProgress``): the microbatches whose parameter gradients
are already accumulated, the forward graphs it kept, and the block outputs and input
gradients it kept for resending. The shadow reports the victim's block from its replica:
its eager-FRC forward graphs (and, with eager BRC, gradients already computed), nothing
accumulated otherwise. From the same reports every worker computes the same plan, so no
further coordination is needed:

- a block runs the backward of a microbatch it has not accumulated yet — for the victim's
  block over the FRC graph: that is lazy BRC, run only for the lost microbatches;
- a backward without a kept graph needs the forward again, whose input comes from the
  predecessor's kept output or from its own recomputed forward (the data for block 0);
- a backward needs its output gradient from the successor, resent if kept, else computed
  by the successor's backward (a pass-through: a block does not accumulate a microbatch
  twice, the ``Interpreter`` checks);
- messages that were in flight when the old links broke are simply resent: a receiver's
  report says what it never got.

Order: every block lists its resends first, then forwards by microbatch, then backwards by
microbatch (GPipe order). Each block's list follows one global order (resends, then
``(m, block)`` for forwards, ``(m, -block)`` for backwards) and every message goes from an
earlier to a later entry of that order, so the plan cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from learner.runtime.schedule import Instr, Op


@dataclass(frozen=True)
class BlockProgress:
    """What the holder of one block still has of the step being resumed."""

    accumulated: frozenset[int] = frozenset()
    graphs: frozenset[int] = frozenset()
    outputs: frozenset[int] = frozenset()
    input_grads: frozenset[int] = frozenset()

    def to_json(self) -> dict[str, list[int]]:
        return {
            "accumulated": sorted(self.accumulated),
            "graphs": sorted(self.graphs),
            "outputs": sorted(self.outputs),
            "input_grads": sorted(self.input_grads),
        }

    @classmethod
    def from_json(cls, data: dict[str, list[int]]) -> BlockProgress:
        return cls(
            frozenset(data.get("accumulated", ())),
            frozenset(data.get("graphs", ())),
            frozenset(data.get("outputs", ())),
            frozenset(data.get("input_grads", ())),
        )

    @classmethod
    def complete(cls, microbatches: int) -> BlockProgress:
        """A block whose gradients are final (stashed for the all-reduce) but keeps nothing."""
        return cls(accumulated=frozenset(range(microbatches)))


@dataclass
class RecoveryPlan:
    """Per block, the instructions left of the step, and how much work that is."""

    programs: dict[int, list[Instr]] = field(default_factory=dict)
    forwards: int = 0
    backwards: int = 0
    resends: int = 0

    @property
    def empty(self) -> bool:
        return not any(self.programs.values())

    def summary(self) -> str:
        if self.empty:
            return "nothing left to compute"
        return f"{self.forwards} forwards, {self.backwards} backwards, {self.resends} resends left"


def plan(stages: int, microbatches: int, progress: dict[int, BlockProgress]) -> RecoveryPlan:
    """The instructions every block of one pipeline still has to run for the step."""
    missing = [b for b in range(stages) if b not in progress]
    if missing:
        raise ValueError(f"no progress report for blocks {missing}")
    fwd: set[tuple[int, int]] = set()
    bwd: set[tuple[int, int]] = set()

    def need_backward(b: int, m: int) -> None:
        if (b, m) in bwd:
            return
        bwd.add((b, m))
        if m not in progress[b].graphs:
            need_forward(b, m)
        if b < stages - 1 and m not in progress[b + 1].input_grads:
            need_backward(b + 1, m)

    def need_forward(b: int, m: int) -> None:
        if (b, m) in fwd:
            return
        fwd.add((b, m))
        if b > 0 and m not in progress[b - 1].outputs:
            need_forward(b - 1, m)

    for m in range(microbatches):
        for b in range(stages):
            if m not in progress[b].accumulated:
                need_backward(b, m)

    keyed: dict[int, list[tuple[tuple[int, int, int], Instr]]] = {b: [] for b in range(stages)}
    out = RecoveryPlan(forwards=len(fwd), backwards=len(bwd))
    for b, m in fwd:
        if b > 0:
            if (b - 1, m) not in fwd:  # the predecessor resends its kept output
                keyed[b - 1].append(((0, m, b - 1), Instr(Op.SEND_ACT, m)))
                out.resends += 1
            keyed[b].append(((1, m, b), Instr(Op.RECV_ACT, m)))
        keyed[b].append(((1, m, b), Instr(Op.FORWARD, m)))
        if (b + 1, m) in fwd:
            keyed[b].append(((1, m, b), Instr(Op.SEND_ACT, m)))
    for b, m in bwd:
        if b < stages - 1:
            if (b + 1, m) not in bwd:  # the successor resends its kept input gradient
                keyed[b + 1].append(((0, m, b + 1), Instr(Op.SEND_GRAD, m)))
                out.resends += 1
            keyed[b].append(((2, m, -b), Instr(Op.RECV_GRAD, m)))
        keyed[b].append(((2, m, -b), Instr(Op.BACKWARD, m)))
        if b > 0 and (b - 1, m) in bwd:
            keyed[b].append(((2, m, -b), Instr(Op.SEND_GRAD, m)))
    # within one key the insertion order (recv, compute, send) is kept: sort is stable
    rank = {Op.RECV_ACT: 0, Op.RECV_GRAD: 0, Op.FORWARD: 1, Op.BACKWARD: 1}
    for b, entries in keyed.items():
        entries.sort(key=lambda e: (e[0], rank.get(e[1].op, 2)))
        out.programs[b] = [ins for _, ins in entries]
    return out
