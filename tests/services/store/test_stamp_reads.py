"""StampedReads (services/store/stamp_reads.py): reads of the records written since the
last read, by their writers' stamps. Properties, over random writes and reads on a
simulated clock: no write is missed that lands within the look-back of its stamp (late
landers, writers' clocks behind or ahead, the reader's clock stepping back); one that
lands within the margin is seen by the next read; and each record is read about twice,
not once per read for the whole look-back."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from services.store.stamp_reads import StampedReads

LOOKBACK_S, MARGIN_S, BAND_S = 5.0, 0.5, 1.0


@dataclass(frozen=True)
class Write:
    key: int
    stamp: float  # the writer's clock when it wrote
    lands: float  # when it is visible to reads (real time)


class World:
    """Real time, the reader's clock (real time less a step back once it happened) and
    the writes visible at each moment."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.step_at, self.step_s = float("inf"), 0.0
        self.writes: list[Write] = []
        self.calls = 0

    def clock(self) -> float:
        return self.t - (self.step_s if self.t >= self.step_at else 0.0)

    def monotonic(self) -> float:
        return self.t

    def first_reads(self, reading: float, after: float) -> float:
        """The first real time from `after` on at which the reader's clock reads at least
        `reading`."""
        if after < self.step_at and max(after, reading) < self.step_at:
            return max(after, reading)
        return max(after, self.step_at, reading + self.step_s)

    def fetch(self, after: float, up_to: float | None) -> list[Write]:
        self.calls += 1
        return [
            w
            for w in self.writes
            if w.lands <= self.t and w.stamp > after and (up_to is None or w.stamp <= up_to)
        ]


writes_st = st.lists(
    st.tuples(
        st.floats(0.0, 30.0),  # when (real time after the start) it is written
        st.floats(-LOOKBACK_S + 0.01, 0.5),  # the writer's clock against the reader's
        st.floats(0.0, 1.0),  # share of the rest of the look-back it takes to land
    ),
    max_size=40,
)
gaps_st = st.lists(st.floats(0.05, 3.0), min_size=1, max_size=80)


@settings(max_examples=300, deadline=None)
@given(
    writes=writes_st,
    gaps=gaps_st,
    step=st.one_of(st.none(), st.tuples(st.floats(0.0, 30.0), st.floats(0.01, 20.0))),
)
# The clock steps back 2 s between two reads, and a write 4 s behind it comes just after:
# stamped below what the read after the step reads as the look-back from its own clock.
@example(writes=[(3.0, -4.0, 0.0)], gaps=[1.0], step=(3.0, 2.0))
def test_no_write_that_lands_within_the_look_back_is_missed(
    writes: list[tuple[float, float, float]],
    gaps: list[float],
    step: tuple[float, float] | None,
) -> None:
    world = World()
    start = world.t
    if step is not None:
        world.step_at, world.step_s = start + step[0], step[1]
    for key, (at, skew, share) in enumerate(writes):
        world.t = start + at
        stamp = world.clock() + skew
        # visible by the time the reader's clock, after the write, first reads LOOKBACK_S
        # past its stamp (what the look-back promises: the writer's clock less than that
        # behind, the write landing before)
        latest = world.first_reads(stamp + LOOKBACK_S, world.t)
        world.writes.append(Write(key, stamp, world.t + share * (latest - world.t)))
    reads = StampedReads(LOOKBACK_S, MARGIN_S, BAND_S, world.clock, world.monotonic)
    world.t = start
    reads.reset(world.clock())
    seen: dict[int, float] = {}
    # reads at random moments, then on for long enough that every write has landed
    moments = [start]
    for gap in gaps:
        moments.append(moments[-1] + gap)
    last_land = max((w.lands for w in world.writes), default=start)
    while moments[-1] < last_land + LOOKBACK_S + BAND_S + 3.0:
        moments.append(moments[-1] + 1.7)
    for moment in moments[1:]:
        world.t = moment
        for w in reads.read(world.fetch):
            assert w.lands <= moment
            seen.setdefault(w.key, moment)
    missed = [w for w in world.writes if w.key not in seen]
    assert missed == []


@settings(max_examples=200, deadline=None)
@given(
    at=st.lists(st.floats(0.0, 20.0), min_size=1, max_size=40),
    period=st.floats(0.05, 2.0),
    delay=st.floats(0.0, MARGIN_S),
)
def test_a_write_that_lands_within_the_margin_is_in_the_next_read_and_read_about_twice(
    at: list[float], period: float, delay: float
) -> None:
    world = World()
    start = world.t
    world.writes = [Write(k, start + a, start + a + delay) for k, a in enumerate(at)]
    reads = StampedReads(LOOKBACK_S, MARGIN_S, BAND_S, world.clock, world.monotonic)
    reads.reset(start)
    times_read: dict[int, int] = {}
    moment = start
    while moment < start + 20.0 + delay + LOOKBACK_S + BAND_S + 2 * period:
        moment += period
        world.t = moment
        found = reads.read(world.fetch)
        for w in found:
            times_read[w.key] = times_read.get(w.key, 0) + 1
        # every write that landed before this read and after the previous one is in it
        landed = {w.key for w in world.writes if moment - period < w.lands <= moment}
        assert landed <= {w.key for w in found}
    # the fast reads from the one during its write to the first that begins a margin
    # after it, and one band
    most = int(MARGIN_S / period) + 3
    assert set(times_read) == {w.key for w in world.writes}
    assert max(times_read.values()) <= most


def test_a_late_write_is_read_by_the_band_once_it_is_older_than_the_look_back() -> None:
    world = World()
    reads = StampedReads(LOOKBACK_S, MARGIN_S, BAND_S, world.clock, world.monotonic)
    reads.reset(world.t)
    late = Write(1, world.t + 0.1, world.t + 3.0)  # lands 2.9 s after its stamp
    world.writes.append(late)
    seen_at = None
    for _ in range(60):
        world.t += 0.2
        if late in reads.read(world.fetch) and seen_at is None:
            seen_at = world.t
    assert seen_at is not None
    # not in a fast read (it landed after they had passed its stamp): in the band read
    # once its stamp is LOOKBACK_S old, at most a band later
    assert late.stamp + LOOKBACK_S <= seen_at <= late.stamp + LOOKBACK_S + BAND_S + 0.2


def test_nothing_moves_on_when_a_fetch_fails() -> None:
    world = World()
    reads = StampedReads(LOOKBACK_S, MARGIN_S, BAND_S, world.clock, world.monotonic)
    reads.reset(world.t)
    world.writes.append(Write(1, world.t + 0.1, world.t + 0.1))
    world.t += 2.0

    def failing(after: float, up_to: float | None) -> list[Write]:
        raise ConnectionError("store away")

    with pytest.raises(ConnectionError):
        reads.read(failing)
    world.t += 2.0
    assert [w.key for w in reads.read(world.fetch)] == [1]


def test_the_margin_must_be_under_the_look_back() -> None:
    with pytest.raises(ValueError):
        StampedReads(1.0, 1.0, 1.0)
