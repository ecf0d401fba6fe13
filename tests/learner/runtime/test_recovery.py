"""The recovery planner: what is left of an interrupted step, without deadlock or loss.

``execute`` runs a plan symbolically — one cursor per block, sends into mailboxes, a recv
waits for its message — the way the engine's block threads run it.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.runtime.recovery import BlockProgress, plan
from learner.runtime.schedule import Instr, Op


def execute(
    stages: int, microbatches: int, progress: dict[int, BlockProgress]
) -> set[tuple[int, int]]:
    """Run the plan; returns (block, microbatch) pairs accumulated. Fails on a deadlock."""
    programs = plan(stages, microbatches, progress).programs
    acc = {(b, m) for b in range(stages) for m in progress[b].accumulated}
    graphs = {(b, m) for b in range(stages) for m in progress[b].graphs}
    outputs = {(b, m) for b in range(stages) for m in progress[b].outputs}
    in_grads = {(b, m) for b in range(stages) for m in progress[b].input_grads}
    mail: set[tuple[str, int, int]] = set()
    got_act: set[tuple[int, int]] = set()
    got_grad: set[tuple[int, int]] = set()
    cursor = dict.fromkeys(range(stages), 0)
    while any(cursor[b] < len(programs[b]) for b in range(stages)):
        moved = False
        for b in range(stages):
            while cursor[b] < len(programs[b]):
                ins: Instr = programs[b][cursor[b]]
                m = ins.microbatch
                if ins.op is Op.RECV_ACT:
                    if ("act", b - 1, m) not in mail:
                        break
                    got_act.add((b, m))
                elif ins.op is Op.RECV_GRAD:
                    if ("grad", b + 1, m) not in mail:
                        break
                    got_grad.add((b, m))
                elif ins.op is Op.FORWARD:
                    assert b == 0 or (b, m) in got_act, f"forward({b},{m}) without input"
                    graphs.add((b, m))
                    outputs.add((b, m))
                elif ins.op is Op.SEND_ACT:
                    assert (b, m) in outputs, f"send_act({b},{m}) of an output nobody has"
                    mail.add(("act", b, m))
                elif ins.op is Op.BACKWARD:
                    assert (b, m) in graphs, f"backward({b},{m}) without a graph"
                    assert b == stages - 1 or (b, m) in got_grad, f"backward({b},{m}) without grad"
                    graphs.discard((b, m))
                    acc.add((b, m))
                    in_grads.add((b, m))
                elif ins.op is Op.SEND_GRAD:
                    assert (b, m) in in_grads, f"send_grad({b},{m}) of a gradient nobody has"
                    mail.add(("grad", b, m))
                cursor[b] += 1
                moved = True
        assert moved, f"deadlock: cursors {cursor} in {programs}"
    return acc


def full(m: int) -> frozenset[int]:
    return frozenset(range(m))


def test_lost_last_stage_after_all_backwards_replays_only_its_backwards() -> None:
    # stage 2 died in the all-reduce: its shadow has FRC graphs of every microbatch and
    # nothing accumulated; the other blocks are done
    progress = {
        0: BlockProgress(full(4), frozenset(), full(4), frozenset()),
        1: BlockProgress(full(4), frozenset(), full(4), full(4)),
        2: BlockProgress(frozenset(), full(4), frozenset(), frozenset()),
    }
    p = plan(3, 4, progress)
    assert p.programs[0] == [] and p.programs[1] == []
    assert p.programs[2] == [Instr(Op.BACKWARD, m) for m in range(4)]
    assert (p.forwards, p.backwards, p.resends) == (0, 4, 0)
    assert execute(3, 4, progress) == {(b, m) for b in range(3) for m in range(4)}


def test_lost_middle_stage_replays_backwards_with_resent_gradients() -> None:
    # stage 1 of 3 died after microbatches 0 and 1 went through every backward; the
    # successor resends the gradients it kept, the victim's FRC graphs give lazy BRC
    progress = {
        0: BlockProgress(frozenset({0, 1}), frozenset({2, 3}), full(4), frozenset()),
        1: BlockProgress(frozenset(), frozenset({0, 1, 2}), frozenset({0, 1, 2}), frozenset()),
        2: BlockProgress(frozenset({0, 1}), frozenset(), frozenset(), frozenset({0, 1})),
    }
    p = plan(3, 4, progress)
    assert Instr(Op.SEND_GRAD, 0) in p.programs[2] and Instr(Op.SEND_GRAD, 1) in p.programs[2]
    # microbatch 3 through blocks 1 and 2, microbatch 2 through block 2 (whose input
    # block 1 resends from its FRC output); block 0 resends its output of microbatch 3
    assert p.forwards == 3
    assert Instr(Op.SEND_ACT, 3) in p.programs[0] and Instr(Op.FORWARD, 3) not in p.programs[0]
    assert Instr(Op.FORWARD, 0) not in p.programs[1]  # the FRC graph is reused
    assert execute(3, 4, progress) == {(b, m) for b in range(3) for m in range(4)}


def test_nothing_kept_recomputes_the_whole_step() -> None:
    progress = dict.fromkeys(range(4), BlockProgress())
    p = plan(4, 3, progress)
    assert (p.forwards, p.backwards) == (12, 12)
    assert execute(4, 3, progress) == {(b, m) for b in range(4) for m in range(3)}


def test_a_complete_pipeline_has_nothing_left() -> None:
    progress = dict.fromkeys(range(3), BlockProgress.complete(4))
    assert plan(3, 4, progress).empty


def test_a_missing_report_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"blocks \[1\]"):
        plan(2, 2, {0: BlockProgress()})


def test_progress_round_trips_through_json() -> None:
    p = BlockProgress(frozenset({1}), frozenset({2}), frozenset({0, 3}), frozenset())
    assert BlockProgress.from_json(p.to_json()) == p


subsets = st.frozensets(st.integers(0, 3))


@settings(max_examples=300, deadline=None)
@given(
    stages=st.integers(2, 4),
    data=st.data(),
)
def test_any_consistent_progress_completes_without_deadlock(
    stages: int, data: st.DataObject
) -> None:
    microbatches = 4
    progress = {}
    for b in range(stages):
        accumulated = data.draw(subsets, label=f"accumulated{b}")
        progress[b] = BlockProgress(
            accumulated,
            data.draw(subsets, label=f"graphs{b}") - accumulated,
            data.draw(subsets, label=f"outputs{b}"),
            data.draw(subsets, label=f"input_grads{b}"),
        )
    acc = execute(stages, microbatches, progress)
    assert acc == set(itertools.product(range(stages), range(microbatches)))
