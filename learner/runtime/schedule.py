"""Per-stage instruction lists (1F1B or GPipe order) with Bamboo's redundant work inserted.

A stage's list covers one training step. The pipeline part (everything before
``ALLREDUCE``) runs in one thread per block the worker owns; the sync part
(``ALLREDUCE``, ``OPTIMIZER``) runs once per worker over all its blocks, because after a
failover one worker owns two blocks and both must reach the all-reduce together.

Where redundant computation goes (Bamboo §4.1):

- ``FRC(m)`` — forward of the replica (the successor's layers) for microbatch ``m``. It
  is not in the list: it has no fixed place where it is always free. The interpreter
  runs it as filler work in the bubble — while a receive is in flight that waited long
  enough in the previous step (``bubbles``) — and whatever found no bubble runs in the
  sync phase before the replica's update. ``Op.FRC`` still names it for kill points.
- ``BRC(m)`` — backward of the replica, only with eager BRC. It needs the gradient the
  successor received, so it follows the stage's own backward of ``m`` (the successor's
  backward of ``m`` happened before); the last stage runs them at the end. Its FRC runs
  first if it has not yet.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Op(enum.StrEnum):
    LOAD = "load"
    RECV_ACT = "recv_act"
    FORWARD = "forward"
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"
    BACKWARD = "backward"
    SEND_GRAD = "send_grad"
    FRC = "frc"
    BRC = "brc"
    ALLREDUCE = "allreduce"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True)
class Instr:
    op: Op
    microbatch: int = -1

    def __str__(self) -> str:
        return f"{self.op.value}({self.microbatch})" if self.microbatch >= 0 else self.op.value


PIPELINE_OPS = frozenset(Op) - {Op.ALLREDUCE, Op.OPTIMIZER}


def order(stage: int, stages: int, microbatches: int, kind: str = "1f1b") -> list[tuple[str, int]]:
    """The ('F'|'B', microbatch) order of one stage."""
    m = microbatches
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if kind != "1f1b":
        raise ValueError(f"schedule {kind!r}: use '1f1b' or 'gpipe'")
    warmup = min(stages - stage - 1, m)
    out = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        out += [("F", warmup + i), ("B", i)]
    out += [("B", i) for i in range(m - warmup, m)]
    return out


def build(
    stage: int,
    stages: int,
    microbatches: int,
    kind: str = "1f1b",
    replica: int | None = None,
    eager_brc: bool = False,
) -> list[Instr]:
    """Instructions of block ``stage`` for one step; ``replica`` is the block it shadows."""
    first, last = stage == 0, stage == stages - 1
    brc = replica is not None and eager_brc
    out: list[Instr] = []
    for phase, m in order(stage, stages, microbatches, kind):
        if phase == "F":
            if first or last:
                out.append(Instr(Op.LOAD, m))
            if not first:
                out.append(Instr(Op.RECV_ACT, m))
            out.append(Instr(Op.FORWARD, m))
            if not last:
                out.append(Instr(Op.SEND_ACT, m))
        else:
            if not last:
                out.append(Instr(Op.RECV_GRAD, m))
            out.append(Instr(Op.BACKWARD, m))
            if not first:
                out.append(Instr(Op.SEND_GRAD, m))
            if brc and not last:
                out.append(Instr(Op.BRC, m))
    if brc and last:
        out += [Instr(Op.BRC, m) for m in range(microbatches)]
    return [*out, Instr(Op.ALLREDUCE), Instr(Op.OPTIMIZER)]


def pipeline_part(program: list[Instr]) -> list[Instr]:
    return [i for i in program if i.op in PIPELINE_OPS]


# Relative costs of the plan's model of a step (PipeDream's and Bamboo's convention: a
# backward is about two forwards; the replica's forward costs one forward of a stage, the
# partition balances the stages).
_COST = {Op.FORWARD: 1.0, Op.BACKWARD: 2.0, Op.BRC: 2.0}
FRC_COST = 1.0


def frc_plan(
    stages: int, microbatches: int, kind: str = "1f1b", eager_brc: bool = False
) -> list[dict[int, int]]:
    """Where each stage's eager FRC goes (Bamboo §5): per stage, {index of a receive in its
    pipeline part: FRC forwards planned into that receive's wait}.

    Every stage's pipeline part is played once with the costs above, each receive waiting
    for its sender; the waits are the warm-up and cool-down bubbles of the order. Each
    wait gets as many FRC forwards as fit in it and are available by then: a stage that
    shadows its successor runs FRC(m) on its own output of ``m`` (so only after its
    forward of ``m``), the last stage, which shadows block 0, on the input batches (any
    time). What fits nowhere is left to the sync phase. The interpreter uses it as the
    last stage's pipeline-fill floor (``BubblePredictor.fits``), and with
    ``Interpreter.cap_to_plan`` as every planned wait's floor and cap.
    """
    if stages < 2:
        return [{}]
    programs = [
        pipeline_part(
            build(s, stages, microbatches, kind, replica=(s + 1) % stages, eager_brc=eager_brc)
        )
        for s in range(stages)
    ]
    pos = [0] * stages
    clock = [0.0] * stages
    sent: dict[tuple[Op, int, int], float] = {}  # (kind, sending stage, mb) -> time
    waits: list[dict[int, float]] = [{} for _ in range(stages)]
    progressed = True
    while progressed:
        progressed = False
        for s in range(stages):
            prog = programs[s]
            while pos[s] < len(prog):
                ins = prog[pos[s]]
                if ins.op in (Op.RECV_ACT, Op.RECV_GRAD):
                    key = (
                        (Op.SEND_ACT, s - 1, ins.microbatch)
                        if ins.op is Op.RECV_ACT
                        else (Op.SEND_GRAD, s + 1, ins.microbatch)
                    )
                    if key not in sent:
                        break  # its sender has not got there yet
                    waits[s][pos[s]] = max(0.0, sent[key] - clock[s])
                    clock[s] = max(clock[s], sent[key])
                elif ins.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    sent[(ins.op, s, ins.microbatch)] = clock[s]
                else:
                    clock[s] += _COST.get(ins.op, 0.0)
                pos[s] += 1
                progressed = True
    if any(pos[s] < len(programs[s]) for s in range(stages)):
        raise ValueError(f"{kind} order of {stages} stages deadlocks: no FRC plan")
    plans: list[dict[int, int]] = []
    for s in range(stages):
        last = s == stages - 1
        plan: dict[int, int] = {}
        planned = forwarded = 0
        for idx, ins in enumerate(programs[s]):
            if ins.op is Op.FORWARD:
                forwarded += 1
            wait = waits[s].get(idx, 0.0)
            if wait <= 0.0:
                continue
            ready = microbatches if last else forwarded
            n = min(int(wait / FRC_COST + 1e-9), ready - planned)
            if n > 0:
                plan[idx] = n
                planned += n
        plans.append(plan)
    return plans
