"""Helpers the runtime's reconfiguration tests share (test_reconfigure, test_growth)."""

from __future__ import annotations

from learner.runtime.cluster_state import ClusterState, EtcdClusterStateStore


def lose(store: EtcdClusterStateStore, worker: int) -> ClusterState:
    """Declare ``worker`` dead the way a survivor does (compare-and-set, lost_at)."""
    state, token = store.get_state()
    assert state is not None
    new = state.bump(
        dead=tuple(sorted({*state.dead, worker})),
        lost_at={**state.lost_at, str(worker): state.generation + 1},
    )
    assert store.set_state(new, token)
    return new
