"""Reconfiguration (Bamboo §4.3): a replacement joins and every block has a replica again.

Who decides what, in which order (keys under ``runtime/``, see ``cluster_state``):

1. Whoever starts a replacement (the launcher with ``--replace``, or on the platform the
   guardian) writes ``tickets/<w>`` = ``{"token", "generation"}`` and gives the process
   the token (``RHIZOME_RUNTIME_JOIN_TOKEN``). ``w`` is the slot of a lost worker, or a
   number >= P × D for a standby that waits for any slot.
2. The joiner (``admit``) checks its ticket against ``state`` and is **refused** — one
   line, exit ``ExitCode.EVICTED`` — when the token is not the ticket's, the ticket was
   used already, or it was issued before the slot's last replacement was admitted
   (stale generation: it belongs to an earlier loss), or when the job is in a fatal
   state (it restarts from its checkpoint). A joiner whose slot is alive queues under
   ``standbys/<w>`` (under its lease) until some slot is lost.
3. It puts ``members/<slot>`` under its lease, then moves the slot out of ``dead`` by
   compare-and-set on ``state`` (generation g+1, ``joined_at[slot] = g+1``) and marks
   its ticket used (``used_at``, and the ``slot`` it took). The CAS is the decision: of two joiners racing for a slot exactly
   one wins, the other queues.
4. Every worker sees generation g+1 and joins it (``Failover._join``). The shadow that
   had promoted the lost block demotes it back to its replica (``demote``); the joiner
   reports itself as such; every report carries ``f`` (fresh) when a holding changed.
   With any fresh report everyone restarts the step to resume from its start — the
   step boundary: versions are made equal by the snapshot rollback, partial work of the
   step is dropped (at most one iteration) — and the keeper of each block the joiner
   needs (the replica holder of its own block, the owner of its replica block) sends it
   the block's parameters and optimizer state at that version (``transfer``), over the
   new generation's links.

The joiner builds the whole model from the seed first (as every worker does), so only
state travels, not structure. The bytes are ``torch.save`` of the module's and the
optimizer's state dicts: exact, so the result stays equal to an uninterrupted run.
"""

from __future__ import annotations

import functools
import io
import time
from dataclasses import dataclass
from typing import Any

import torch

from learner.runtime.api import LinkError, RuntimeFailure
from learner.runtime.cluster_state import ClusterStateStore
from learner.runtime.comm import Transport, first_sentence, interruptible, tag
from learner.runtime.topology import Topology
from learner.runtime.worker_state import BlockState, StepProgress, WorkerState

# Message kind of the hand-over (comm's kinds are 1..4; kept apart from them).
HANDOVER = 9


class Refused(Exception):
    """A joiner that may not join: the reason names what was wrong."""


@dataclass(frozen=True)
class Ticket:
    token: str
    generation: int

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Ticket:
        return cls(str(raw["token"]), int(raw["generation"]))


def issue_ticket(cluster: ClusterStateStore, worker: int, token: str) -> Ticket:
    """Allow one replacement into slot ``worker`` (or a standby numbered ``worker``)."""
    state, _ = cluster.get_state()
    ticket = Ticket(token, state.generation if state is not None else 0)
    cluster.put(f"tickets/{worker}", {"token": ticket.token, "generation": ticket.generation})
    return ticket


def _check(cluster: ClusterStateStore, candidate: int, token: str) -> Ticket:
    state, _ = cluster.get_state()
    if state is None:
        raise Refused(
            "no running job to join: the cluster state does not exist (no worker of the job "
            "wrote generation 0 in time); start the job's workers first"
        )
    if state.fatal:
        raise Refused(f"the job lost a stage and its shadow ({state.fatal}); nothing to join")
    raw = cluster.get(f"tickets/{candidate}")
    if raw is None or str(raw.get("token")) != token:
        raise Refused(
            f"worker {candidate}: token is stale or unknown (no matching tickets/{candidate});"
            " only a replacement started by the launcher or the guardian may join"
        )
    ticket = Ticket.from_dict(raw)
    if raw.get("used_at") is not None:
        raise Refused(
            f"worker {candidate}: its ticket was used at generation {raw['used_at']}; "
            "a token joins once"
        )
    joined = state.joined_at.get(str(candidate))
    if joined is not None and ticket.generation < joined:
        raise Refused(
            f"worker {candidate}: ticket of generation {ticket.generation} predates the "
            f"replacement admitted into slot {candidate} at generation {joined} "
            "(stale generation: it was issued for an earlier loss)"
        )
    return ticket


def admit(
    cluster: ClusterStateStore,
    candidate: int,
    token: str,
    ttl_s: float,
    poll_s: float = 0.05,
    log: Any = print,
    start_timeout_s: float = 120.0,
) -> int:
    """Wait for a slot and take it; returns the slot. Raises ``Refused``.

    The caller's lease (granted here) holds ``members/<slot>`` from before the
    admission, so the running workers never see the new member without a lease.

    A standby started together with the job (the launcher's ``--standbys``) can get here
    before the workers have written generation 0: it waits up to ``start_timeout_s`` for
    the job to start rather than being refused for a race it cannot see.
    """
    deadline = time.monotonic() + start_timeout_s
    if cluster.get_state()[0] is None:
        log(f"joiner {candidate}: waiting for the job's generation 0")
        while cluster.get_state()[0] is None and time.monotonic() < deadline:
            time.sleep(poll_s)
    queued = False
    while True:
        ticket = _check(cluster, candidate, token)
        cluster.keepalive()
        state, rev = cluster.get_state()
        assert state is not None
        if cluster.get_prefix(f"done/{state.generation}/"):
            raise Refused(
                f"worker {candidate}: the job is finishing (generation {state.generation}); "
                "nothing left to join"
            )
        n = state.stages * state.pipelines
        free = sorted(w for w in state.dead if w < n)
        slot = candidate if candidate in free else (free[0] if free else None)
        if slot is None:
            if not queued:
                cluster.hold(f"standbys/{candidate}", {"since": time.time()}, ttl_s)
                log(f"standby {candidate}: queued (no lost slot in generation {state.generation})")
                queued = True
            time.sleep(poll_s)
            continue
        cluster.hold(f"members/{slot}", {"slot": slot}, ttl_s)
        new = state.bump(
            dead=tuple(w for w in state.dead if w != slot),
            joined_at={**state.joined_at, str(slot): state.generation + 1},
        )
        if cluster.set_state(new, rev):
            cluster.put(
                f"tickets/{candidate}",
                # the slot it took: the guardian names who serves the slot from this
                {
                    "token": token,
                    "generation": ticket.generation,
                    "used_at": new.generation,
                    "slot": slot,
                },
            )
            if queued:
                cluster.release(f"standbys/{candidate}")
            log(f"joiner {candidate}: admitted into slot {slot} -> generation {new.generation}")
            return slot
        # lost the race (a failure, another joiner): read again


def demote(st: WorkerState, topo: Topology) -> bool:
    """Give back owned blocks the new configuration gives to a joiner; True if any.

    The block becomes this worker's replica again when the topology says so (the shadow
    of a lost worker gets back to shadowing it), else it is dropped.
    """
    changed = False
    for b in sorted(st.owned):
        if topo.owner(st.pipe, b) == st.me:
            continue
        blk = st.owned.pop(b)
        st.progress.accumulated.pop(b, None)
        changed = True
        if topo.replica_block(st.me) == b and st.replica is None:
            blk.stash_step, blk.stash, blk.acc = -1, None, []
            st.replica = blk
            st.log(f"demoted block {b} to replica: its slot's replacement owns it again")
        else:
            st.log(f"handed block {b} over: a joiner owns it")
    return changed


def restart_step(st: WorkerState, resume: int) -> None:
    """Start step ``resume`` afresh: everyone does, so every holding of it is dropped."""
    with st.lock:
        st.progress = StepProgress(resume)
        st.frc = {}
        for blk in st.owned.values():
            blk.stash_step, blk.stash = -1, None
            blk.acc = [torch.zeros_like(p) for p in blk.params]


def needs(topo: Topology, joiner: int) -> list[tuple[int, bool, int]]:
    """What ``joiner`` receives: (block, as replica, keeper), in one order both sides use."""
    d = topo.pipeline_of(joiner)
    out: list[tuple[int, bool, int]] = []
    for b in topo.owned_blocks(joiner):
        keeper = topo.replica_holder(d, b)
        if keeper is None:
            raise RuntimeFailure(f"block {b} of pipeline {d} has no live keeper to hand over")
        out.append((b, False, keeper))
    rep = topo.replica_block(joiner)
    if rep is not None:
        out.append((rep, True, topo.owner(d, rep)))
    return out


def _encode(blk: BlockState) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(
        {
            "module": blk.module.state_dict(),
            "optimizer": blk.optimizer.state_dict(),
            "version": blk.version,
        },
        buf,
    )
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _decode(blk: BlockState, raw: torch.Tensor) -> None:
    got = torch.load(io.BytesIO(raw.cpu().numpy().tobytes()), weights_only=True)
    blk.module.load_state_dict(got["module"])
    blk.optimizer.load_state_dict(got["optimizer"])
    blk.version = int(got["version"])
    blk.snapshot = None


def transfer(
    st: WorkerState, topo: Topology, joiners: list[int], tr: Transport, resume: int
) -> None:
    """Keepers send, joiners receive, each block a joiner needs (after the rollback)."""
    cpu = torch.device("cpu")
    sends: list[Any] = []
    for j in sorted(joiners):
        for b, as_replica, keeper in needs(topo, j):
            t_len = tag(HANDOVER, b, resume, 2 * int(as_replica))
            t_data = tag(HANDOVER, b, resume, 2 * int(as_replica) + 1)
            if keeper == st.me and j != st.me:
                # the joiner's replica block is owned here; its own block is this
                # worker's replica (the shadow's, demoted back)
                held = st.owned.get(b) if as_replica else st.replica
                if held is None or held.index != b:
                    raise RuntimeFailure(f"worker {st.me} keeps no block {b} for joiner {j}")
                data = _encode(held).to(st.device)
                size = torch.tensor([data.numel()], dtype=torch.int64, device=st.device)
                sends.append(tr.send(j, t_len, size))
                sends.append(tr.send(j, t_data, data))
                st.log(f"handed block {b} (version {held.version}) to joiner {j}")
            elif j == st.me:
                size = interruptible(
                    functools.partial(tr.recv, keeper, t_len, torch.Size([1]), torch.int64),
                    st.changed,
                    f"hand-over size of block {b}",
                )
                n = int(size.to(cpu).item())
                data = interruptible(
                    functools.partial(tr.recv, keeper, t_data, torch.Size([n]), torch.uint8),
                    st.changed,
                    f"hand-over of block {b}",
                )
                target = st.replica if as_replica else st.owned.get(b)
                if target is None or target.index != b:
                    raise RuntimeFailure(f"joiner {st.me} has no place for block {b}")
                _decode(target, data)
                st.log(
                    f"received block {b}{' (replica)' if as_replica else ''} at version "
                    f"{target.version} from worker {keeper}"
                )
    for work in sends:
        if work is None:
            continue
        try:
            interruptible(work.wait, st.changed, "hand-over send")
        except RuntimeError as exc:  # the joiner died mid-hand-over: a lost peer, not a crash
            raise LinkError(-1, f"hand-over send: {first_sentence(exc)}") from exc
