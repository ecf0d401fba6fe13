"""What a worker's watcher knows of its job's runtime keys, kept current by an etcd watch.

The watcher used to poll etcd (``get_state`` + ``alive_members``, every 50 ms, on every
worker: about a tenth of a CPU-bound iteration here, and etcd's CPU). Now the store's
watch (``ClusterStateStore.watch``, resumed across disconnects, a compaction answered by
one full re-read) feeds ``ClusterView.apply``, which keeps the latest state, the live
members and who finished, and wakes the watcher; in steady training nothing changes under
the prefix and nobody reads etcd. Failure detection is as fast as before or faster: an
expired lease deletes ``members/<w>``, and the deletion arrives as an event instead of at
the next poll.

What is ignored, not applied: a ``state`` older than the one held (a stale generation:
the state only moves forward, by compare-and-set), a value that does not parse, and keys
the watcher has no business with (rendezvous reports, failures, the partition). Keys of
another prefix never reach here (``contract.etcd_watch.PrefixWatch`` drops them).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from contract.etcd_watch import Change
from learner.runtime.cluster_state import ClusterState


@dataclass(frozen=True)
class ViewSnapshot:
    state: ClusterState | None
    members: frozenset[int]
    # workers ever seen registered: only they can be missing (a worker that has not
    # registered yet is start-up's business, not a failure)
    seen: frozenset[int]
    done: dict[int, frozenset[int]] = field(default_factory=dict)  # generation -> workers
    # queued standbys (``standbys/<w>``, under their leases)
    standbys: frozenset[int] = frozenset()


class ClusterView:
    """The latest ``state``, live ``members/*``, queued ``standbys/*`` and ``done/<g>/*`` of
    one job, from its watch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: ClusterState | None = None
        self._members: set[int] = set()
        self._seen: set[int] = set()
        self._done: dict[int, set[int]] = {}
        self._standbys: set[int] = set()
        # set on every applied change: the watcher's only wake-up besides its lease timer
        self.changed = threading.Event()
        self.ignored: list[str] = []  # why each ignored change was ignored (tests, logs)

    def apply(self, changes: list[Change], full: bool) -> None:
        """The store's watch callback: ``full`` replaces everything, else ``changes`` apply."""
        with self._lock:
            if full:
                self._members.clear()
                self._done.clear()
                self._standbys.clear()
            for change in changes:
                self._apply(change)
        self.changed.set()

    def _apply(self, change: Change) -> None:
        key = change.key
        if key == "state":
            if change.deleted:
                self.ignored.append("state deleted")  # only the job's cleanup does that
                return
            try:
                state = ClusterState.from_dict(dict(change.value))
            except (TypeError, ValueError) as exc:
                self.ignored.append(f"state unreadable: {exc}")
                return
            if self._state is not None and state.generation < self._state.generation:
                self.ignored.append(
                    f"stale state of generation {state.generation} "
                    f"(holding {self._state.generation})"
                )
                return
            self._state = state
        elif key.startswith("members/"):
            worker = _int(key.removeprefix("members/"))
            if worker is None:
                self.ignored.append(f"member key {key!r}")
            elif change.deleted:
                self._members.discard(worker)
            else:
                self._members.add(worker)
                self._seen.add(worker)
        elif key.startswith("standbys/"):
            worker = _int(key.removeprefix("standbys/"))
            if worker is None:
                self.ignored.append(f"standby key {key!r}")
            elif change.deleted:
                self._standbys.discard(worker)
            else:
                self._standbys.add(worker)
        elif key.startswith("done/"):
            gen, _, w = key.removeprefix("done/").partition("/")
            g, worker = _int(gen), _int(w)
            if g is None or worker is None:
                self.ignored.append(f"done key {key!r}")
            elif not change.deleted:
                self._done.setdefault(g, set()).add(worker)

    def snapshot(self) -> ViewSnapshot:
        with self._lock:
            return ViewSnapshot(
                self._state,
                frozenset(self._members),
                frozenset(self._seen),
                {g: frozenset(ws) for g, ws in self._done.items()},
                frozenset(self._standbys),
            )


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None
