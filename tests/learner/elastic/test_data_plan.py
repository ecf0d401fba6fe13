"""The data plan, exactly once: an in-memory twin of the job's coordinator (replicas that
each hold a plan and a step counter, re-formed the way learner/elastic/worker.py does it:
the state of the worker with the most steps, then `reassign`) driven through random joins,
graceful leaves and deaths, including a death after which only some survivors completed
the step's all-reduce. The sample log must cover every epoch exactly once."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.elastic.data import DataPlan, choose_source


@dataclass
class Twin:
    """Replicas of the plan and step counter, one per live worker, plus the sample log."""

    plan: DataPlan
    members: list[str]
    replicas: dict[str, tuple[DataPlan, int]] = field(default_factory=dict)
    log: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    epochs_done: list[list[int]] = field(default_factory=list)
    next_id: int = 0
    max_step_seen: int = 0

    def __post_init__(self) -> None:
        self.replicas = {w: (self.plan, 0) for w in self.members}
        self.next_id = len(self.members)

    def _assignments(self) -> tuple[DataPlan, dict[str, tuple[int, int] | None]]:
        outs = {w: self.replicas[w][0].assign(self.members) for w in self.members}
        first = outs[self.members[0]]
        assert all(o == first for o in outs.values()), "replicas diverged"
        return first

    def _commit(self, workers: list[str], new: DataPlan, got: dict, epoch: int, step: int) -> None:
        ids = new.sample_ids()
        samples = sorted(ids[p] for r in got.values() if r for p in range(*r))
        for w in workers:
            self.replicas[w] = (new, step + 1)
        if workers:
            previous = self.log.setdefault((epoch, step), samples)
            assert previous == samples, "a step was committed twice with different samples"

    def boundary(self) -> None:
        plan, step = self.replicas[self.members[0]]
        if plan.exhausted():
            epoch_samples = [
                s for (e, _), ids in sorted(self.log.items()) if e == plan.epoch for s in ids
            ]
            self.epochs_done.append(epoch_samples)
            for w in self.members:
                self.replicas[w] = (plan.next_epoch(), step)

    def step(self, dies: str | None = None, finishers: frozenset[str] = frozenset()) -> None:
        plan, step = self.replicas[self.members[0]]
        new, got = self._assignments()
        if dies is None:
            self._commit(self.members, new, got, plan.epoch, step)
        else:  # a worker died mid-step: some survivors may have completed the all-reduce
            self._commit(
                [w for w in self.members if w in finishers and w != dies],
                new,
                got,
                plan.epoch,
                step,
            )
            del self.replicas[dies]
            self.reform([w for w in self.members if w != dies])

    def reform(self, members: list[str], joiners: tuple[str, ...] = ()) -> None:
        source = choose_source({w: self.replicas[w][1] for w in members})
        plan, step = self.replicas[source]
        assert step >= self.max_step_seen, "the step counter went back"
        self.max_step_seen = step
        self.members = [*members, *joiners]
        plan = plan.reassign(self.members)
        self.replicas = {w: (plan, step) for w in self.members}

    def join(self) -> None:
        self.next_id += 1
        self.reform(list(self.members), (f"w{self.next_id:03d}",))

    def leave(self, index: int) -> None:
        leaver = self.members[index % len(self.members)]
        self.reform([w for w in self.members if w != leaver])


events = st.lists(
    st.one_of(
        st.just(("step",)),
        st.just(("join",)),
        st.tuples(st.just("leave"), st.integers(0, 7)),
        st.tuples(st.just("die"), st.integers(0, 7), st.sets(st.integers(0, 7))),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(
    events=events,
    num_samples=st.integers(1, 60),
    batch_size=st.integers(1, 7),
    block_size=st.integers(1, 20),
    start=st.integers(1, 4),
)
def test_every_epoch_covers_each_sample_exactly_once(
    events: list[tuple], num_samples: int, batch_size: int, block_size: int, start: int
) -> None:
    twin = Twin(
        DataPlan(num_samples, batch_size, block_size, seed=7), [f"w{i:03d}" for i in range(start)]
    )
    for event in events:
        kind = event[0]
        if kind == "step":
            twin.step()
        elif kind == "join":
            twin.join()
        elif kind == "leave" and len(twin.members) > 1:
            twin.leave(event[1])
        elif kind == "die" and len(twin.members) > 1:
            victim = twin.members[event[1] % len(twin.members)]
            finishers = frozenset(twin.members[i % len(twin.members)] for i in event[2])
            twin.step(dies=victim, finishers=finishers)
        twin.boundary()
    while len(twin.epochs_done) < 2:  # train the rest of the epoch, then check it whole
        twin.step()
        twin.boundary()
    for samples in twin.epochs_done:
        assert sorted(samples) == list(range(num_samples))
    open_epoch = [
        s
        for (e, _), ids in twin.log.items()
        if e == twin.replicas[twin.members[0]][0].epoch
        for s in ids
    ]
    assert len(open_epoch) == len(set(open_epoch)), "a sample was used twice in the open epoch"


def test_a_failed_step_is_redone_by_whoever_holds_the_range() -> None:
    plan = DataPlan(num_samples=8, batch_size=2, block_size=4, shuffle=False)
    _, got = plan.assign(["a", "b"])
    assert got == {"a": (0, 2), "b": (4, 6)}
    # b died before the step completed: nobody committed, a's range and b's block remain
    replan = plan.reassign(["a"])
    _, again = replan.assign(["a"])
    assert again == {"a": (0, 2)}
    assert replan.returned == ()  # b held nothing committed yet: its block was never handed out


def test_a_departed_workers_remainder_is_handed_out_before_fresh_blocks() -> None:
    plan = DataPlan(num_samples=12, batch_size=2, block_size=4, shuffle=False)
    plan, _ = plan.assign(["a", "b"])  # a: [0,2) of [0,4), b: [4,6) of [4,8)
    plan = plan.reassign(["a", "c"])
    assert plan.returned == ((6, 8),)
    _, got = plan.assign(["a", "c"])
    assert got == {"a": (2, 4), "c": (6, 8)}


def test_the_plan_round_trips_through_json_and_rejects_garbage() -> None:
    plan, _ = DataPlan(num_samples=10, batch_size=3, block_size=4, seed=3).assign(["x"])
    assert DataPlan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="not a data plan"):
        DataPlan.from_json({"epoch": 1})
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        DataPlan(num_samples=10, batch_size=0, block_size=4)


def test_the_source_is_the_worker_with_the_most_steps() -> None:
    assert choose_source({"b": 5, "a": 4, "c": 5}) == "b"
