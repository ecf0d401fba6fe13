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

Growth by a whole pipeline (D+1, Bamboo §4.3: "used when a pipeline is lost or when
enough standbys exist to add a whole pipeline"):

5. A ticket may allow growth: ``max_pipelines`` in ``tickets/<w>`` (the launcher's
   ``--max-pipelines``, on the platform the manifest's ``pipeline.max_pipelines``;
   absent: no growth beyond the D asked for). A queued standby looks, each time it
   polls, whether every worker of generation 0 has started (``started/<w>``, written
   once a worker is past its generation-0 check), P standbys are queued (``standbys/*``,
   not counting those the latest growth admitted already), no slot is dead (lost slots are filled first: a standby
   takes a dead slot before anything else) and D < its ticket's ``max_pipelines``
   (``plan_growth``). If so, and it is one of the P lowest-numbered queued standbys, it
   writes generation g+1 by compare-and-set on ``state``: ``pipelines`` D+1, ``grown`` = those P standbys in slot order (standby
   ``grown[i]`` takes slot P×D+i: stage i of pipeline D, the numbering of
   ``topology``), ``grown_at[D+1]`` = g+1. The CAS is the decision: of several standbys
   deciding at once exactly one write lands, the others read it. The decider then puts
   its ``members/<slot>`` (after, not before: a slot no worker has seen registered is
   not declared dead, while a key left by a lost race would be). Each standby named in
   ``grown`` (with a ticket issued before g+1) finds itself there at its next poll,
   puts ``members/<slot>``, marks its ticket used (``used_at`` g+1, ``slot``) and runs as
   that worker.
6. Every running worker sees g+1 with D+1 pipelines and joins it as in 4: the joiners'
   reports say ``j``, so everyone restarts the step at the lowest version; the joiners
   of a whole new pipeline get each block they need (their stage's block, and the
   replica block) from that block's owner in the lowest pipeline that kept its state
   (``needs``), over links of the new generation built for the hand-over
   (``handover_peers``); the all-reduce groups (``Topology.group``) are D+1 wide.

Data with D+1 pipelines: pipeline ``d`` trains on its own microbatches ``batch(step, d,
m)`` as before, so the new pipeline adds M microbatches per step and the global batch
grows from D×M to (D+1)×M microbatches (the loss of each is scaled by 1/(M×(D+1)): the
step's loss stays the mean over the global batch). That is data parallelism as Bamboo
uses it: each pipeline is a data-parallel replica with its own per-iteration batch, and
adding a pipeline adds throughput (more samples per iteration), not a re-split of the
same samples. ``reference.reference_train`` with ``grow_at`` computes the same.

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
from learner.runtime.cluster_state import ClusterState, ClusterStateStore
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
    # the most pipelines this joiner may grow the job to (0: no growth)
    max_pipelines: int = 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Ticket:
        return cls(str(raw["token"]), int(raw["generation"]), int(raw.get("max_pipelines") or 0))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"token": self.token, "generation": self.generation}
        if self.max_pipelines:
            out["max_pipelines"] = self.max_pipelines
        return out


def issue_ticket(
    cluster: ClusterStateStore, worker: int, token: str, max_pipelines: int = 0
) -> Ticket:
    """Allow one replacement into slot ``worker`` (or a standby numbered ``worker``);
    ``max_pipelines`` > D lets it, with P - 1 other standbys, add a whole pipeline."""
    state, _ = cluster.get_state()
    ticket = Ticket(token, state.generation if state is not None else 0, max_pipelines)
    cluster.put(f"tickets/{worker}", ticket.to_dict())
    return ticket


def plan_growth(
    state: ClusterState,
    queued: list[int],
    candidate: int,
    max_pipelines: int,
    started: int,
) -> tuple[ClusterState, int] | None:
    """The state of a growth to D+1 that ``candidate`` may write, and the slot it takes;
    None when no growth is due (a pure function of what the standby read).

    Due when every worker of generation 0 has started (``started`` of them wrote
    ``started/<w>``: one that had not would find the job past generation 0 and refuse to
    run), no slot is dead (a lost slot is filled first), the job is not fatal, D is
    below ``max_pipelines`` (the candidate's ticket), and at least P standbys are queued
    besides those the latest growth admitted already; the P lowest-numbered of them take
    the new pipeline's slots in order, and only one of them writes it."""
    if state.dead or state.fatal or state.pipelines >= max_pipelines:
        return None
    if started < state.stages * (state.pipelines - len(state.grown_at)):
        return None
    P, D = state.stages, state.pipelines
    waiting = sorted(set(queued) - set(state.grown))
    if len(waiting) < P or candidate not in waiting[:P]:
        return None
    chosen = tuple(waiting[:P])
    new = state.bump(
        pipelines=D + 1,
        grown=chosen,
        grown_at={**state.grown_at, str(D + 1): state.generation + 1},
    )
    return new, P * D + chosen.index(candidate)


def grown_slot(state: ClusterState, candidate: int, ticket: Ticket) -> int | None:
    """The slot the latest growth admitted ``candidate`` into, or None. Only a ticket
    issued before that growth counts (a later ticket of the same number is another
    learner: a replacement)."""
    if candidate not in state.grown:
        return None
    at = state.grown_at.get(str(state.pipelines))
    if at is None or ticket.generation >= at:
        return None
    return state.stages * (state.pipelines - 1) + state.grown.index(candidate)


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
        grown = grown_slot(state, candidate, ticket)
        if grown is not None:
            # another standby's compare-and-set admitted this one into the new pipeline
            cluster.hold(f"members/{grown}", {"slot": grown}, ttl_s)
            _mark_used(cluster, candidate, ticket, state.grown_at[str(state.pipelines)], grown)
            if queued:
                cluster.release(f"standbys/{candidate}")
            log(
                f"standby {candidate}: admitted into slot {grown} of the new pipeline "
                f"{state.pipelines - 1} (generation {state.grown_at[str(state.pipelines)]})"
            )
            return grown
        n = state.stages * state.pipelines
        free = sorted(w for w in state.dead if w < n)
        slot = candidate if candidate in free else (free[0] if free else None)
        if slot is None:
            if not queued:
                cluster.hold(f"standbys/{candidate}", {"since": time.time()}, ttl_s)
                log(f"standby {candidate}: queued (no lost slot in generation {state.generation})")
                queued = True
            queue = [int(k.split("/", 1)[1]) for k in cluster.get_prefix("standbys/")]
            plan = None
            if ticket.max_pipelines > state.pipelines and len(queue) >= state.stages:
                started = len(cluster.get_prefix("started/"))
                plan = plan_growth(state, queue, candidate, ticket.max_pipelines, started)
            if plan is not None:
                new, slot = plan
                # members/<slot> only once admitted: a slot no worker has seen registered
                # is not declared dead (engine), a key left by a lost race could be
                if cluster.set_state(new, rev):
                    cluster.hold(f"members/{slot}", {"slot": slot}, ttl_s)
                    _mark_used(cluster, candidate, ticket, new.generation, slot)
                    cluster.release(f"standbys/{candidate}")
                    log(
                        f"standby {candidate}: grew the job to {new.pipelines} pipelines, "
                        f"standbys {list(new.grown)} take slots "
                        f"{state.stages * state.pipelines}..{state.stages * new.pipelines - 1}"
                        f"; this one slot {slot} -> generation {new.generation}"
                    )
                    return slot
                continue  # lost the race (a failure, a joiner, another growth): read again
            time.sleep(poll_s)
            continue
        cluster.hold(f"members/{slot}", {"slot": slot}, ttl_s)
        new = state.bump(
            dead=tuple(w for w in state.dead if w != slot),
            joined_at={**state.joined_at, str(slot): state.generation + 1},
        )
        if cluster.set_state(new, rev):
            _mark_used(cluster, candidate, ticket, new.generation, slot)
            if queued:
                cluster.release(f"standbys/{candidate}")
            log(f"joiner {candidate}: admitted into slot {slot} -> generation {new.generation}")
            return slot
        # lost the race (a failure, another joiner): read again


def lost_growth_joiners(
    state: ClusterState, members: frozenset[int], standbys: frozenset[int]
) -> list[int]:
    """Slots of the latest growth whose standby is gone before it registered: neither
    ``members/<slot>`` (put once it saw its admission) nor ``standbys/<w>`` (held until
    then) is there, so its lease ran out. Nobody saw it registered, so the lease watch
    would never call it missing and the rendezvous would wait for it for ever; the
    watcher declares it dead instead (a failover inside the new pipeline: its other
    joiners hold its block from the hand-over)."""
    if not state.grown:
        return []
    base = state.stages * (state.pipelines - 1)
    return [
        base + i
        for i, standby in enumerate(state.grown)
        if base + i not in state.dead and base + i not in members and standby not in standbys
    ]


def _mark_used(
    cluster: ClusterStateStore, candidate: int, ticket: Ticket, generation: int, slot: int
) -> None:
    # the slot it took: the guardian names who serves the slot from this
    cluster.put(f"tickets/{candidate}", {**ticket.to_dict(), "used_at": generation, "slot": slot})


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
            blk.stash_step, blk.stash, blk.acc, blk.acc_flat = -1, None, [], None
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
        for b, blk in st.owned.items():
            blk.stash_step, blk.stash = -1, None
            blk.fresh_acc(1 if b == st.P - 1 else 0)


def needs(
    topo: Topology, joiner: int, joiners: list[int] | tuple[int, ...] = ()
) -> list[tuple[int, bool, int]]:
    """What ``joiner`` receives: (block, as replica, keeper), in one order both sides use.

    A joiner into a pipeline that kept someone (a replacement) gets its block from that
    block's replica holder and its replica block from that block's owner, both of its
    own pipeline. A joiner of a pipeline made only of ``joiners`` (a growth) gets both
    from their owners in the lowest pipeline that kept its state: data-parallel
    replicas hold equal blocks."""
    d = topo.pipeline_of(joiner)
    out: list[tuple[int, bool, int]] = []
    fresh = {*joiners, joiner}
    if all(w in fresh for w in topo.alive if topo.pipeline_of(w) == d):
        src = next(
            (
                e
                for e in range(topo.pipelines)
                if any(w not in fresh for w in topo.alive if topo.pipeline_of(w) == e)
            ),
            None,
        )
        if src is None:
            raise RuntimeFailure(f"joiner {joiner}: no pipeline kept the model to hand over")
        out = [(b, False, topo.owner(src, b)) for b in topo.owned_blocks(joiner)]
        rep_block = topo.replica_block(joiner)
        if rep_block is not None:
            out.append((rep_block, True, topo.owner(src, rep_block)))
        return out
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
    blk.drop_prepared()


def handover_peers(topo: Topology, me: int, joiners: list[int]) -> set[int]:
    """Whom ``me`` exchanges hand-over messages with besides its pipeline peers: a keeper
    in another pipeline and the joiners of a new pipeline it hands blocks to."""
    out: set[int] = set()
    for j in joiners:
        for _, _, keeper in needs(topo, j, joiners):
            if keeper == me:
                out.add(j)
            if j == me:
                out.add(keeper)
    out.discard(me)
    return out


def transfer(
    st: WorkerState, topo: Topology, joiners: list[int], tr: Transport, resume: int
) -> None:
    """Keepers send, joiners receive, each block a joiner needs (after the rollback)."""
    cpu = torch.device("cpu")
    sends: list[Any] = []
    for j in sorted(joiners):
        for b, as_replica, keeper in needs(topo, j, joiners):
            t_len = tag(HANDOVER, b, resume, 2 * int(as_replica))
            t_data = tag(HANDOVER, b, resume, 2 * int(as_replica) + 1)
            if keeper == st.me and j != st.me:
                # what is held here as block b: an owned block (the joiner's replica
                # block, or any block of a new pipeline), else the replica (the joiner's
                # own block, which the shadow demoted back)
                held = st.owned.get(b) or st.replica
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
