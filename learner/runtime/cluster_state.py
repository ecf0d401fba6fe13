"""The runtime's cluster state and where it is kept (etcd, or memory for unit tests).

Keys under ``contract.etcd_keys.runtime_prefix(job_id)`` (``/rhizome/jobs/<job_id>/runtime/``;
every value is small JSON, < 1 KB):

``state``                  generation, P, D, dead workers, fatal reason (see ``ClusterState``)
``members/<worker>``       present while the worker's lease lives: liveness
``failures/<rep>-<sus>``   what a worker saw when a peer failed (reporter, suspect, reason)
``rendezvous/<gen>/<w>``   a survivor's report when it joins generation ``gen``
``partition``              the layer boundaries every worker uses
``tickets/<w>``            a replacement's admission ticket: token and the generation it was
                           issued at, and ``max_pipelines`` if it may grow the job (written by
                           whoever starts the replacement: the launcher, or on the platform the
                           guardian; learner/runtime/reconfigure.py)
``standbys/<w>``           present while a standby waits for a slot (under its lease)
``started/<w>``            a worker of generation 0 is past its start-up check (a growth
                           waits for every one of them)

``state`` changes only by compare-and-set on its etcd ``mod_revision`` (the fencing
token), exactly like torch.distributed.elastic's rendezvous ``get_state()`` /
``set_state(state, token)``, so concurrent reporters of the same failure converge on
one generation and a transition is never applied twice.

Status of a configuration as read from ``state``:

- ``generation`` g, ``fatal`` null: running; a worker whose own generation is older
  must join generation g (rendezvous) before its next all-reduce.
- ``dead`` grows by exactly the newly lost workers at each generation; a dead worker
  that is still running (it was only slow) finds itself there and exits (evicted).
- ``fatal`` set: some block has no live holder; every worker stops and the job
  restarts from its latest checkpoint.
- ``lost_at[w]``: the generation at which worker slot ``w`` was last declared dead;
  ``joined_at[w]``: the generation its last replacement was admitted at — a ticket for
  slot ``w`` issued before that is stale. A generation that removes a slot from
  ``dead`` is a reconfiguration (learner/runtime/reconfigure.py).
- ``pipelines`` D grows to D+1 (growth, Bamboo §4.3): ``grown`` lists the P standbys
  admitted into the new pipeline's slots P×D … P×D+P−1, in slot order, and
  ``grown_at[str(D+1)]`` is the generation of that growth. Only with ``dead`` empty.

Every transition, by who makes it (each a compare-and-set on the token read: token 0 for
the first, generation g to g+1 for the others; ``fatal`` is final — nothing moves after
it):

==================  =============================  ==========================================
from                to                             made by, when
==================  =============================  ==========================================
(no state)          generation 0, D = D asked      the first worker (``initial_state``)
running             running, ``dead`` + {w}        a survivor (``Failover.declare_dead``; a
                                                   growth's standby gone before it registered:
                                                   the watcher, ``lost_growth_joiners``)
running             fatal                          a survivor whose ``dead`` + {w} leaves a
                                                   block with no holder (same CAS)
running, w dead     running, w alive again,        a ticketed joiner (``reconfigure.admit``)
                    ``joined_at[w]`` = g+1
running, none dead  running, D+1, ``grown``,       a queued standby that sees P standbys
                    ``grown_at[D+1]`` = g+1        queued and D < its ticket's
                                                   ``max_pipelines`` (``reconfigure.admit``)
fatal               (erased)                       the platform's restart from the checkpoint
==================  =============================  ==========================================
"""

from __future__ import annotations

import abc
import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from contract import etcd_keys
from contract.etcd import EtcdClient, Lease, encode
from contract.etcd_watch import Change, PrefixWatch
from learner.runtime.api import ConfigError


@dataclass(frozen=True)
class ClusterState:
    generation: int
    stages: int
    pipelines: int
    dead: tuple[int, ...] = ()
    fatal: str | None = None
    # (pipeline, stages) of the fatal loss, for the restart hook
    fatal_pipeline: int = -1
    fatal_stages: tuple[int, ...] = field(default_factory=tuple)
    # worker slot (as a string: JSON keys) -> generation it was last declared dead in
    lost_at: dict[str, int] = field(default_factory=dict)
    # worker slot -> generation its last replacement was admitted at
    joined_at: dict[str, int] = field(default_factory=dict)
    # the standbys (their ticket numbers) admitted by the latest growth, in slot order:
    # grown[i] took slot P × (pipelines - 1) + i (reconfigure.py)
    grown: tuple[int, ...] = field(default_factory=tuple)
    # pipelines after a growth (as a string: JSON keys) -> the generation it happened at
    grown_at: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> ClusterState:
        return cls.from_dict(json.loads(raw))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ClusterState:
        data = dict(raw)
        data["dead"] = tuple(data.get("dead", ()))
        data["fatal_stages"] = tuple(data.get("fatal_stages", ()))
        data["lost_at"] = {str(k): int(v) for k, v in data.get("lost_at", {}).items()}
        data["joined_at"] = {str(k): int(v) for k, v in data.get("joined_at", {}).items()}
        data["grown"] = tuple(int(c) for c in data.get("grown", ()))
        data["grown_at"] = {str(k): int(v) for k, v in data.get("grown_at", {}).items()}
        return cls(**data)

    def bump(self, **changes: Any) -> ClusterState:
        return replace(self, generation=self.generation + 1, **changes)


Token = int
OnChange = Callable[[list[Change], bool], None]


class ClusterStateStore(abc.ABC):
    """Cluster state, liveness and small per-generation records of one job's runtime."""

    @abc.abstractmethod
    def get_state(self) -> tuple[ClusterState | None, Token]:
        """The state and its fencing token (0 when there is no state yet)."""

    @abc.abstractmethod
    def set_state(self, state: ClusterState, token: Token) -> bool:
        """Write ``state`` if nobody wrote since ``token`` was read; True when written."""

    @abc.abstractmethod
    def register(self, worker: int, ttl_s: float) -> None:
        """Mark ``worker`` alive under a lease of ``ttl_s`` seconds."""

    @abc.abstractmethod
    def hold(self, key: str, value: dict[str, Any], ttl_s: float = 2.0) -> None:
        """Put ``key`` under this process's lease (granted with ``ttl_s`` if there is none
        yet; ``register`` then reuses it): the record vanishes with the process."""

    @abc.abstractmethod
    def release(self, key: str) -> None:
        """Delete ``key`` (a record this process holds)."""

    @abc.abstractmethod
    def keepalive(self) -> None:
        """Refresh this process's lease."""

    @abc.abstractmethod
    def alive_members(self) -> set[int]:
        """Workers whose lease has not expired."""

    @abc.abstractmethod
    def put(self, key: str, value: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    def create(self, key: str, value: dict[str, Any]) -> bool:
        """Put ``key`` only if it does not exist; True when this call created it (a
        one-time decision: the first writer wins, as with ``set_state`` from token 0)."""

    @abc.abstractmethod
    def get(self, key: str) -> dict[str, Any] | None: ...

    @abc.abstractmethod
    def get_prefix(self, prefix: str) -> dict[str, dict[str, Any]]:
        """Key (relative to the job's runtime prefix) -> value, for keys under ``prefix``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop keeping the lease (the key expires) and release the client."""

    @abc.abstractmethod
    def watch(self, on_change: OnChange) -> Callable[[], None]:
        """Deliver every change of this job's runtime keys to ``on_change(changes, full)``.

        Keys are relative to the runtime prefix (``state``, ``members/3``); a membership
        ends as a deletion of ``members/<w>``. First call: ``full=True`` with every key.
        Returns a function that stops the watch. (The step loop's watcher, issue #24.)
        """

    def record_failure(self, reporter: int, suspect: int, reason: str, step: int) -> None:
        self.put(
            f"failures/{reporter}-{suspect}",
            {
                "reporter": reporter,
                "suspect": suspect,
                "reason": reason[:300],
                "step": step,
                "time": time.time(),
            },
        )


def _check_small(key: str, raw: str) -> None:
    if len(raw) >= 1024:
        raise ConfigError(f"value of {key} is {len(raw)} bytes; runtime values must stay < 1 KB")


class InMemoryClusterStateStore(ClusterStateStore):
    """A shared in-process twin of the etcd store (unit tests, in-process runs).

    Several workers share one ``Shared`` backing; each gets its own view via ``view()``.
    """

    class Shared:
        def __init__(self) -> None:
            self.lock = threading.Lock()
            self.revision = 0
            self.data: dict[str, tuple[str, int]] = {}
            self.leases: dict[int, float] = {}  # worker -> expiry (monotonic)
            self.watchers: list[OnChange] = []

        def notify(self, key: str, value: Any, deleted: bool = False) -> None:
            """Called under ``lock`` after a change (revision already bumped)."""
            change = Change(key, value, self.revision, deleted)
            for watcher in list(self.watchers):
                watcher([change], False)

    def __init__(self, shared: Shared | None = None) -> None:
        self._shared = shared or InMemoryClusterStateStore.Shared()
        self._worker: int | None = None
        self._ttl = 0.0

    def view(self) -> InMemoryClusterStateStore:
        return InMemoryClusterStateStore(self._shared)

    def get_state(self) -> tuple[ClusterState | None, Token]:
        with self._shared.lock:
            got = self._shared.data.get("state")
        if got is None:
            return None, 0
        return ClusterState.from_json(got[0]), got[1]

    def set_state(self, state: ClusterState, token: Token) -> bool:
        raw = state.to_json()
        _check_small("state", raw)
        with self._shared.lock:
            current = self._shared.data.get("state")
            if (current[1] if current else 0) != token:
                return False
            self._shared.revision += 1
            self._shared.data["state"] = (raw, self._shared.revision)
            self._shared.notify("state", state.to_dict())
            return True

    def register(self, worker: int, ttl_s: float) -> None:
        self._worker, self._ttl = worker, ttl_s
        self.keepalive()
        with self._shared.lock:
            self._shared.revision += 1
            self._shared.notify(f"members/{worker}", worker)

    def keepalive(self) -> None:
        if self._worker is not None:
            with self._shared.lock:
                self._shared.leases[self._worker] = time.monotonic() + self._ttl

    def hold(self, key: str, value: dict[str, Any], ttl_s: float = 2.0) -> None:
        # leases are per worker here; a held record lives as long as the data
        self.put(key, value)

    def release(self, key: str) -> None:
        with self._shared.lock:
            self._shared.data.pop(key, None)

    def expire(self, worker: int) -> None:
        """Test hook: the worker's lease runs out now."""
        with self._shared.lock:
            if self._shared.leases.pop(worker, None) is not None:
                self._shared.revision += 1
                self._shared.notify(f"members/{worker}", None, deleted=True)

    def alive_members(self) -> set[int]:
        now = time.monotonic()
        with self._shared.lock:
            return {w for w, exp in self._shared.leases.items() if exp > now}

    def put(self, key: str, value: dict[str, Any]) -> None:
        raw = json.dumps(value, separators=(",", ":"))
        _check_small(key, raw)
        with self._shared.lock:
            self._shared.revision += 1
            self._shared.data[key] = (raw, self._shared.revision)
            self._shared.notify(key, value)

    def create(self, key: str, value: dict[str, Any]) -> bool:
        raw = json.dumps(value, separators=(",", ":"))
        _check_small(key, raw)
        with self._shared.lock:
            if key in self._shared.data:
                return False
            self._shared.revision += 1
            self._shared.data[key] = (raw, self._shared.revision)
            self._shared.notify(key, value)
        return True

    def get(self, key: str) -> dict[str, Any] | None:
        with self._shared.lock:
            got = self._shared.data.get(key)
        return None if got is None else dict(json.loads(got[0]))

    def get_prefix(self, prefix: str) -> dict[str, dict[str, Any]]:
        with self._shared.lock:
            items = [(k, v[0]) for k, v in self._shared.data.items() if k.startswith(prefix)]
        return {k: dict(json.loads(v)) for k, v in items}

    def close(self) -> None:
        if self._worker is not None:
            self.expire(self._worker)

    def watch(self, on_change: OnChange) -> Callable[[], None]:
        # a lease that runs out by time sends nothing here (only ``expire`` does): in-process
        # runs cannot lose a worker anyway (see inprocess)
        shared = self._shared
        with shared.lock:
            now = time.monotonic()
            full = [Change(k, json.loads(v), rev) for k, (v, rev) in shared.data.items()]
            full += [
                Change(f"members/{w}", w, shared.revision)
                for w, exp in shared.leases.items()
                if exp > now
            ]
            on_change(full, True)
            shared.watchers.append(on_change)

        def cancel() -> None:
            with shared.lock:
                if on_change in shared.watchers:
                    shared.watchers.remove(on_change)

        return cancel


class EtcdClusterStateStore(ClusterStateStore):
    """The cluster state in etcd, through the contract's one etcd client."""

    def __init__(self, endpoint: str, job_id: str) -> None:
        try:
            self._client = EtcdClient(endpoint, timeout_s=10)
        except ValueError as exc:
            raise ConfigError(f"etcd endpoint {endpoint!r}: {exc}") from None
        self.prefix = etcd_keys.runtime_prefix(job_id)
        # Refreshed from the worker's own loop (`keepalive`), never from a thread of its
        # own: a hung worker must lose its membership.
        self._lease: Lease | None = None

    def _key(self, key: str) -> str:
        return self.prefix + key

    def get_state(self) -> tuple[ClusterState | None, Token]:
        entry = self._client.get(self._key("state"))
        if entry is None:
            return None, 0
        return ClusterState.from_dict(entry.value), entry.mod_revision

    def set_state(self, state: ClusterState, token: Token) -> bool:
        value = state.to_dict()
        _check_small("state", encode(value).decode())
        return self._client.cas(self._key("state"), value, token)

    def register(self, worker: int, ttl_s: float) -> None:
        # one lease per process: a standby admitted into a slot keeps the lease it waited
        # under, so its `members/<slot>` (put before the admission) stays valid
        if self._lease is None:
            self._lease = self._client.grant(max(1, round(ttl_s)))
        self._client.put(self._key(f"members/{worker}"), worker, lease=self._lease)

    def hold(self, key: str, value: dict[str, Any], ttl_s: float = 2.0) -> None:
        if self._lease is None:
            self._lease = self._client.grant(max(1, round(ttl_s)))
        _check_small(key, encode(value).decode())
        self._client.put(self._key(key), value, lease=self._lease)

    def release(self, key: str) -> None:
        self._client.delete(self._key(key))

    def keepalive(self) -> None:
        if self._lease is not None:
            self._lease.refresh()

    def alive_members(self) -> set[int]:
        prefix = self._key("members/")
        return {int(key[len(prefix) :]) for key in self._client.get_prefix(prefix)}

    def put(self, key: str, value: dict[str, Any]) -> None:
        _check_small(key, encode(value).decode())
        self._client.put(self._key(key), value)

    def create(self, key: str, value: dict[str, Any]) -> bool:
        _check_small(key, encode(value).decode())
        return self._client.create(self._key(key), value)

    def get(self, key: str) -> dict[str, Any] | None:
        entry = self._client.get(self._key(key))
        return None if entry is None else dict(entry.value)

    def get_prefix(self, prefix: str) -> dict[str, dict[str, Any]]:
        return {
            key[len(self.prefix) :]: dict(entry.value)
            for key, entry in self._client.get_prefix(self._key(prefix)).items()
        }

    def delete_all(self) -> None:
        self._client.delete_prefix(self.prefix)

    def watch(self, on_change: OnChange) -> Callable[[], None]:
        cut = len(self.prefix)

        def relative(changes: list[Change], full: bool) -> None:
            on_change([replace(c, key=c.key[cut:]) for c in changes], full)

        return PrefixWatch(self._client, self.prefix, relative).start().stop

    def close(self) -> None:
        if self._lease is not None:
            self._lease.revoke()
            self._lease = None
        self._client.close()


def initial_state(
    store: ClusterStateStore, stages: int, pipelines: int, joining: bool = False
) -> ClusterState:
    """Create generation 0 if nobody has (first writer wins), then return the state.

    A joiner (``joining``) may find more pipelines than it was started for: the job grew
    (reconfigure.py) — it runs in the state's shape."""
    state, _ = store.get_state()
    if state is None:
        store.set_state(ClusterState(generation=0, stages=stages, pipelines=pipelines), 0)
        state, _ = store.get_state()
    assert state is not None
    grown = joining and state.stages == stages and state.pipelines >= pipelines
    if (state.stages, state.pipelines) != (stages, pipelines) and not grown:
        raise ConfigError(
            f"cluster state has {state.stages} stages x {state.pipelines} pipelines but this "
            f"worker was started for {stages} x {pipelines}: the job id is reused or the "
            "launcher flags differ"
        )
    return state
