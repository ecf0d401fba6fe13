from __future__ import annotations

import pytest

from learner.runtime.schedule import Instr, Op, build, frc_plan, order, pipeline_part


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


def _planned(stages: int, micro: int, kind: str = "1f1b") -> list[list[tuple[str, int]]]:
    """Per stage: (receive, FRC forwards planned in its wait), in program order."""
    plans = frc_plan(stages, micro, kind)
    out = []
    for s in range(stages):
        prog = pipeline_part(build(s, stages, micro, kind, replica=(s + 1) % stages))
        out.append([(str(prog[i]), n) for i, n in sorted(plans[s].items())])
    return out


def test_frc_plan_fills_the_warm_up_and_cool_down_bubbles_of_two_stages() -> None:
    # Bamboo §5 on 2 stages x 4 microbatches (forward 1, backward 2): stage 0 waits two
    # units for the first gradient (its FRC of microbatches 0 and 1, whose outputs it has)
    # and one unit for the last; the last stage one unit for the first activation
    assert _planned(2, 4) == [
        [("recv_grad(0)", 2), ("recv_grad(3)", 1)],
        [("recv_act(0)", 1)],
    ]


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 4, 7])
def test_frc_plan_plans_only_receives_and_only_frc_that_can_run_there(
    kind: str, stages: int, micro: int
) -> None:
    plans = frc_plan(stages, micro, kind)
    for s, plan in enumerate(plans):
        prog = pipeline_part(build(s, stages, micro, kind, replica=(s + 1) % stages))
        assert sum(plan.values()) <= micro
        planned = 0
        for idx, ins in enumerate(prog):
            planned += plan.get(idx, 0)
            if idx in plan:
                assert ins.op in (Op.RECV_ACT, Op.RECV_GRAD)
                if s != stages - 1:  # FRC(m) runs on this stage's own output of m
                    forwarded = sum(1 for i in prog[: idx + 1] if i.op is Op.FORWARD)
                    assert planned <= forwarded


def test_frc_plan_of_one_stage_is_empty() -> None:
    assert frc_plan(1, 4) == [{}]
