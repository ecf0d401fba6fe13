"""Membership of an elastic job through etcd (docs/elastic.md, "Protocol").

Keys (contract/etcd_keys.py, under `<job>/elastic/`):
- `workers/<w>`: a worker's liveness, bound to its lease (gone when it leaves or dies);
- `leader`: created by the leader, bound to its lease: whoever creates it leads, and when
  the leader leaves or dies the key goes and the next worker at a boundary creates it;
- `state`: {generation, members, store}; only the leader writes it, each write a
  compare-and-set on the revision it read (the fencing token, as `set_state(state,
  token)` in torch.distributed.elastic's rendezvous), so a deposed leader cannot write;
- `joins/<w>`: a ready joiner's request naming the generation it read; `refused/<w>` why
  the leader refused it (a stale generation);
- `acks/<w>`: a member's "alive at the boundary of generation g" during a re-form;
- `abort`: the newest generation a worker saw fail mid-collective;
- `leaves/<w>`: why a member left (graceful, straggler), for the scheduler and the logs;
- `plan`: the leader's copy of the data plan and the step, rewritten at every re-form;
- `expect`: {count, deadline}, the guardian's "I am adding `count` learners": the leader
  holds their joins until all `count` wait or the deadline passes, so they enter together.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from contract import etcd_keys as keys
from contract.etcd import EtcdClient, Lease
from learner.elastic.api import ElasticError, StaleGeneration

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Membership:
    generation: int
    members: tuple[str, ...]
    store: str  # HOST:PORT of the generation's TCPStore, hosted by its leader

    @classmethod
    def from_json(cls, value: Any) -> Membership:
        return cls(int(value["generation"]), tuple(value["members"]), str(value["store"]))

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.generation, "members": list(self.members), "store": self.store}


EMPTY = Membership(0, (), "")


class Rendezvous:
    """One worker's view of the job's membership keys."""

    def __init__(
        self,
        etcd: EtcdClient,
        job_id: str,
        worker: str,
        *,
        lease_ttl_s: int = 2,
        host: str = "127.0.0.1",
        ack_timeout_s: float = 30.0,
    ) -> None:
        self.etcd = etcd
        self.job = job_id
        self.me = worker
        self.host = host
        self.ack_timeout_s = ack_timeout_s
        self.lease: Lease = etcd.grant(lease_ttl_s).keep_alive()
        self.joins_changed = threading.Event()  # a join request came or went
        self.abort_changed = threading.Event()  # a worker saw a generation break
        self._cancels = [
            etcd.watch_prefix(keys.elastic_joins_prefix(job_id), self.joins_changed.set),
            etcd.watch(keys.elastic_abort(job_id), self.abort_changed.set),
        ]
        self.stores: list[dist.TCPStore] = []  # the master stores this worker hosts
        etcd.put(
            keys.elastic_worker(job_id, worker),
            {"pid": os.getpid(), "host": socket.gethostname()},
            lease=self.lease,
        )

    # -- reads ------------------------------------------------------------------------------
    def membership(self) -> tuple[Membership, int]:
        """The current membership and its revision (0 when none was ever formed)."""
        entry = self.etcd.get(keys.elastic_state(self.job))
        if entry is None:
            return EMPTY, 0
        return Membership.from_json(entry.value), entry.mod_revision

    def live_workers(self) -> set[str]:
        prefix = keys.elastic_workers_prefix(self.job)
        return {k[len(prefix) :] for k in self.etcd.get_prefix(prefix)}

    def pending_joins(self) -> dict[str, int]:
        prefix = keys.elastic_joins_prefix(self.job)
        return {
            k[len(prefix) :]: int(e.value["generation"])
            for k, e in self.etcd.get_prefix(prefix).items()
        }

    def aborted(self, generation: int) -> bool:
        entry = self.etcd.get(keys.elastic_abort(self.job))
        return entry is not None and int(entry.value) >= generation

    # -- a worker's writes ------------------------------------------------------------------
    def request_join(self, generation: int) -> None:
        self.etcd.delete(keys.elastic_refusal(self.job, self.me))
        self.etcd.put(
            keys.elastic_join(self.job, self.me), {"generation": generation}, lease=self.lease
        )

    def refusal(self) -> dict[str, Any] | None:
        entry = self.etcd.get(keys.elastic_refusal(self.job, self.me))
        return None if entry is None else dict(entry.value)

    def ack(self, generation: int, step: int) -> None:
        self.etcd.put(
            keys.elastic_ack(self.job, self.me),
            {"generation": generation, "step": step},
            lease=self.lease,
        )

    def abort(self, generation: int) -> None:
        """Tell every member that generation `generation` broke, so none waits on it."""
        entry = self.etcd.get(keys.elastic_abort(self.job))
        if entry is None or int(entry.value) < generation:
            self.etcd.put(keys.elastic_abort(self.job), generation)

    def joins_ready(self, joins: dict[str, int]) -> bool:
        """Whether the leader admits the pending `joins` now. Yes, unless the platform is
        adding several learners at once (`expect`) and fewer than that many wait yet,
        before its deadline: the others keep training meanwhile, and the joiners then
        enter in one re-form instead of one each (each re-form stalls every member: the
        platform's 2 -> 4 took two, 2.3-3.1 iterations, where one costs about 1)."""
        entry = self.etcd.get(keys.elastic_expect(self.job))
        if entry is None or not isinstance(entry.value, dict):
            return True
        try:
            count, deadline = int(entry.value["count"]), float(entry.value["deadline"])
        except (KeyError, TypeError, ValueError):
            return True  # unreadable: do not hold anybody on it
        return len(joins) >= count or time.time() >= deadline

    def expectation_met(self) -> None:
        """The expected joiners are being admitted: later joins are not held for them."""
        self.etcd.delete(keys.elastic_expect(self.job))

    def is_leader(self) -> bool:
        """Whether this worker leads, trying to become leader if nobody does."""
        key = keys.elastic_leader(self.job)
        if self.etcd.create(key, self.me, lease=self.lease):
            log.info("%s leads job %s", self.me, self.job)
            return True
        entry = self.etcd.get(key)
        return entry is not None and entry.value == self.me

    def leave(self, reason: str, step: int) -> None:
        """Leave at a boundary: say why, then drop liveness and leadership at once (no
        lease expiry to wait for), so the leader re-forms without this worker."""
        self.etcd.put(keys.elastic_leave(self.job, self.me), {"reason": reason, "step": step})
        leader = self.etcd.get(keys.elastic_leader(self.job))
        if leader is not None and leader.value == self.me:
            self.etcd.delete_if(leader.key, leader.mod_revision)
        self.etcd.delete(keys.elastic_worker(self.job, self.me))
        self.close()

    def close(self) -> None:
        for cancel in self._cancels:
            cancel()
        self.lease.revoke()

    # -- the leader's transition --------------------------------------------------------------
    def form_next(
        self, current: Membership, token: int, *, min_workers: int = 1
    ) -> Membership | None:
        """As leader, form generation `current.generation + 1`: the members still alive that
        acknowledged the boundary (waiting for each until it acks, its lease expires or
        `ack_timeout_s` passes) plus the joiners that asked for the current generation
        (others are refused as stale). None when the state moved under us (fenced) or,
        at the first formation, fewer than `min_workers` asked to join yet."""
        deadline = time.monotonic() + self.ack_timeout_s
        acks_prefix = keys.elastic_acks_prefix(self.job)
        while True:
            live = self.live_workers()
            acks = {
                k.rsplit("/", 1)[1]: int(e.value["generation"])
                for k, e in self.etcd.get_prefix(acks_prefix).items()
            }
            waiting = [
                m for m in current.members if m in live and acks.get(m) != current.generation
            ]
            if not waiting or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        stay = [m for m in current.members if m in live and acks.get(m) == current.generation]
        for m in current.members:
            if m not in stay:
                log.warning(
                    "generation %d: %s is gone (left, died or never reached the boundary)",
                    current.generation,
                    m,
                )
        joiners = []
        for worker, generation in sorted(self.pending_joins().items()):
            if worker in stay:
                continue
            if generation != current.generation or worker not in live:
                self.etcd.put(
                    keys.elastic_refusal(self.job, worker),
                    {
                        "asked": generation,
                        "current": current.generation,
                        "reason": f"stale generation {generation}; the job is at {current.generation}: re-read and ask again",
                    },
                )
                self.etcd.delete(keys.elastic_join(self.job, worker))
                log.warning(
                    "refused %s: it asked for generation %d at %d",
                    worker,
                    generation,
                    current.generation,
                )
                continue
            joiners.append(worker)
        members = (*stay, *joiners)
        if not current.members and len(members) < min_workers:
            return None
        if not members:
            raise ElasticError(
                f"job {self.job}: no worker left to form generation {current.generation + 1}"
            )
        store = dist.TCPStore(self.host, 0, len(members), True, wait_for_workers=False)
        nxt = Membership(current.generation + 1, members, f"{self.host}:{store.port}")
        if not self.etcd.cas(keys.elastic_state(self.job), nxt.to_json(), token):
            return None  # fenced: the state changed since we read it
        self.stores = [
            *self.stores[-1:],
            store,
        ]  # the previous one may still be in use for a moment
        for worker in joiners:
            self.etcd.delete(keys.elastic_join(self.job, worker))
        log.info("generation %d: members %s", nxt.generation, ", ".join(members))
        return nxt

    def check_refused(self, asked: int) -> None:
        refusal = self.refusal()
        if refusal is not None and int(refusal.get("asked", -1)) == asked:
            raise StaleGeneration(f"join refused: {refusal.get('reason', 'stale generation')}")
