from __future__ import annotations

import pytest

from learner.runtime.schedule import Instr, Op, build, order, pipeline_part


@pytest.mark.parametrize("stages,micro", [(2, 3), (3, 4), (4, 2), (4, 8)])
def test_1f1b_runs_every_microbatch_forward_before_backward(stages: int, micro: int) -> None:
    for s in range(stages):
        seq = order(s, stages, micro)
        assert sorted(m for p, m in seq if p == "F") == list(range(micro))
        assert sorted(m for p, m in seq if p == "B") == list(range(micro))
        for m in range(micro):
            assert seq.index(("F", m)) < seq.index(("B", m))


def test_1f1b_limits_in_flight_microbatches_to_the_depth_left() -> None:
    stages, micro = 4, 8
    for s in range(stages):
        in_flight = peak = 0
        for p, _ in order(s, stages, micro):
            in_flight += 1 if p == "F" else -1
            peak = max(peak, in_flight)
        assert peak == stages - s  # 1F1B's memory bound; GPipe would hold all 8


def test_gpipe_is_all_forwards_then_all_backwards() -> None:
    seq = order(1, 3, 3, "gpipe")
    assert seq == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]


def test_frc_is_filler_work_outside_the_list() -> None:
    # eager FRC runs in the bubble the interpreter finds (learner.runtime.bubbles)
    for stage, replica in ((0, 1), (2, 0)):
        prog = build(stage, 3, 3, replica=replica, eager_brc=False)
        assert not any(i.op in (Op.FRC, Op.BRC) for i in prog)


def test_eager_brc_follows_own_backward() -> None:
    prog = build(0, 3, 3, replica=1, eager_brc=True)
    for m in range(3):
        assert prog.index(Instr(Op.BRC, m)) > prog.index(Instr(Op.BACKWARD, m))


def test_last_stage_runs_eager_brc_after_its_backwards() -> None:
    prog = pipeline_part(build(2, 3, 2, replica=0, eager_brc=True))
    assert [i.op for i in prog[-2:]] == [Op.BRC, Op.BRC]


def test_program_ends_with_allreduce_and_optimizer_outside_the_pipeline_part() -> None:
    prog = build(1, 2, 2)
    assert prog[-2:] == [Instr(Op.ALLREDUCE), Instr(Op.OPTIMIZER)]
    assert Op.ALLREDUCE not in {i.op for i in pipeline_part(prog)}


def test_first_stage_loads_and_never_receives_activations() -> None:
    prog = build(0, 3, 2)
    assert Instr(Op.LOAD, 0) in prog
    assert not any(i.op in (Op.RECV_ACT, Op.SEND_GRAD) for i in prog)


def test_unknown_schedule_is_rejected() -> None:
    with pytest.raises(ValueError, match="'zigzag'"):
        order(0, 2, 2, "zigzag")
