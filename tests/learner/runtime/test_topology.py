from __future__ import annotations

import pytest

from learner.runtime.topology import Topology


def test_initial_owners_and_replicas() -> None:
    t = Topology(3, 2)
    assert [t.owner(1, b) for b in range(3)] == [3, 4, 5]
    assert t.replica_block(0) == 1 and t.replica_block(2) == 0
    assert t.group(1) == [1, 4]
    assert t.peers(1) == [0, 2]


def test_shadow_owns_the_lost_block_and_neighbours_are_rerouted() -> None:
    t = Topology(3, 1, frozenset({1}))
    assert t.owned_blocks(0) == [0, 1]
    assert t.replica_block(0) is None  # promoted
    assert t.peers(0) == [2]
    assert t.peers(2) == [0]
    assert t.fatal_reason() is None


def test_last_stage_shadows_the_first() -> None:
    t = Topology(4, 1, frozenset({0}))
    assert t.owned_blocks(3) == [0, 3]
    assert t.owner(0, 0) == 3


def test_consecutive_losses_are_fatal_and_named() -> None:
    reason, pipe, stages = Topology(4, 2, frozenset({5, 6})).fatal_info()
    assert reason is not None and "pipeline 1 lost consecutive stages 1 and 2" in reason
    assert (pipe, stages) == (1, (1, 2))


def test_wraparound_loss_of_last_and_first_is_fatal() -> None:
    reason, _, stages = Topology(3, 1, frozenset({0, 2})).fatal_info()
    assert reason is not None and stages == (0, 2)


def test_non_consecutive_losses_are_survivable() -> None:
    assert Topology(4, 1, frozenset({0, 2})).fatal_reason() is None


def test_no_redundancy_makes_any_loss_fatal() -> None:
    t = Topology(3, 1, frozenset({1}), redundancy=False)
    assert t.fatal_reason() is not None and "redundancy is 'none'" in t.fatal_reason()  # type: ignore[operator]
    with pytest.raises(LookupError):
        t.owner(0, 1)
