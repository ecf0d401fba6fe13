"""Failover (ARCHITECTURE §5): declaring a peer dead and joining the next generation.

A link error, or a lease that expired, makes a worker declare the peer dead with a
compare-and-set on the cluster state: generation ``g+1``. Every survivor then joins
``g+1``: the shadow promotes its replica (parameters, optimizer state, version, and the
eager-FRC results of the interrupted step) to an owned block and so runs the victim's
work next to its own — victim↔shadow messages become local hand-offs, neighbours are
rerouted to the shadow. Survivors report per-block versions at the rendezvous; the step
to resume is the lowest version (blocks one step ahead roll back from their snapshot,
which is exact). The step is not restarted: what every worker still holds of it
(``StepProgress``: accumulated microbatches, kept forward graphs, outputs and input
gradients) goes into the report too, and ``recovery.plan`` turns the reports into what is
left — for the victim's block, the backward over its eager-FRC graphs of the microbatches
it had already finished (lazy BRC, only for those), then the victim's remaining forwards
and backwards; messages lost with the old links are resent from what the senders kept. A
pipeline that lost nobody and had finished its microbatches only re-runs the all-reduce.
Every pipeline keeps its microbatches, so the global batch is unchanged and the result
equals an uninterrupted run.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from learner.runtime import reconfigure
from learner.runtime.api import Evicted, FatalFailure, Interrupted, LinkError, RuntimeFailure
from learner.runtime.cluster_state import ClusterState, ClusterStateStore
from learner.runtime.comm import Groups, Transport, interruptible
from learner.runtime.recovery import BlockProgress, RecoveryPlan
from learner.runtime.recovery import plan as recovery_plan
from learner.runtime.schedule import Instr
from learner.runtime.topology import Topology
from learner.runtime.worker_state import BlockState, StepProgress, WorkerState


class Failover:
    """Declares peers dead and brings this worker into each new generation."""

    def __init__(self, state: WorkerState, cluster: ClusterStateStore, store: dist.Store) -> None:
        self.state = state
        self.cluster = cluster
        self.store = store
        # links and groups of past generations: never destroyed, since closing their
        # sockets would look like a failure to a peer still blocked on them (see comm)
        self._graveyard: list[Any] = []
        # a replacement admitted into a running job: its first join receives its blocks
        self.joining = state.opts.join_token is not None

    # ---------------------------------------------------------------- detection

    def declare_dead(self, suspect: int, reason: str) -> None:
        st = self.state
        self.cluster.record_failure(st.me, suspect, reason, st.step)
        while True:
            state, token = self.cluster.get_state()
            assert state is not None
            if suspect in state.dead or state.fatal:
                return
            topo = Topology(
                st.P, state.pipelines, frozenset(state.dead) | {suspect}, st.mode.has_replica
            )
            fatal, fpipe, fstages = topo.fatal_info()
            new = state.bump(
                dead=tuple(sorted(topo.dead)),
                lost_at={**state.lost_at, str(suspect): state.generation + 1},
                fatal=fatal,
                fatal_pipeline=fpipe,
                fatal_stages=fstages,
            )
            if self.cluster.set_state(new, token):
                st.log(
                    f"declared worker {suspect} dead ({reason}) -> generation {new.generation}"
                    + (f"; FATAL: {fatal}" if fatal else "")
                )
                st.changed.set()
                return

    def on_link_error(self, err: LinkError) -> None:
        if self.state.changed.is_set() or err.peer < 0:
            return
        self.declare_dead(err.peer, err.reason)

    def read_state(self) -> ClusterState:
        """The cluster state; raises if the job is lost or this worker was declared dead."""
        state, _ = self.cluster.get_state()
        assert state is not None
        if state.fatal:
            raise FatalFailure(state.fatal, state.fatal_pipeline, state.fatal_stages)
        if self.state.me in state.dead:
            raise Evicted(f"worker {self.state.me} was declared dead by its peers")
        return state

    # ----------------------------------------------------------------- recovery

    def recover(self) -> tuple[int, dict[int, list[Instr]] | None]:
        """Join the new generation: the step to resume and what is left of it, per owned
        block; None when the step restarts from its start (a reconfiguration)."""
        st = self.state
        opts = st.opts
        t0 = time.monotonic()
        # A link error not yet turned into a new generation: wait for a detector.
        if not st.changed.wait(opts.detection_timeout_s + 2 * opts.lease_ttl_s):
            raise RuntimeFailure(
                "a link failed but no failure was declared within the detection timeout"
            )
        while True:
            try:
                step, rest = self._join()
                if rest is None:
                    st.log(
                        f"joined generation {st.generation} in {time.monotonic() - t0:.3f} s "
                        f"(reconfiguration): owns blocks {sorted(st.owned)}, replica "
                        f"{st.replica.index if st.replica else None}, step {step} from its start"
                    )
                    return step, None
                mine = {b: rest.programs[b] for b in st.owned}
                st.log(
                    f"joined generation {st.generation} in {time.monotonic() - t0:.3f} s: "
                    f"owns blocks {sorted(st.owned)}, resume at step {step}; "
                    f"pipeline {st.pipe}: {rest.summary()}"
                )
                return step, mine
            except Interrupted:
                continue
            except LinkError as exc:  # another loss while joining
                st.log(f"joining generation {st.generation}: {exc}")
                self.on_link_error(exc)
                if not st.changed.wait(opts.detection_timeout_s + 2 * opts.lease_ttl_s):
                    raise RuntimeFailure(
                        f"joining failed and no failure was declared: {exc}"
                    ) from exc

    def _join(self) -> tuple[int, RecoveryPlan | None]:
        st = self.state
        # the replica's received updates, applied on the updater's thread, are in before
        # the epoch moves (the fence would discard them), before its version is reported
        # and before it is promoted, demoted, handed over or rolled back
        waited = st.settle_replica()
        if waited > 0:
            st.log(f"joining: waited {waited:.3f} s for the replica's update being applied")
        state = self.read_state()
        with st.lock:
            st.epoch += 1
            st.generation = state.generation
            # D+1 after a growth (reconfigure.py): the loss scale and groups follow it
            st.D = state.pipelines
            st.changed.clear()
            if st.transport is not None:
                st.transport.close()
                self._graveyard.append(st.transport)
            if st.groups is not None:
                self._graveyard.append(st.groups)
        # the state may have moved again between the read and the clear
        if self.read_state().generation != st.generation:
            st.changed.set()
            raise Interrupted("generation moved during join")
        topo = Topology(st.P, state.pipelines, frozenset(state.dead), st.mode.has_replica)
        st.topo = topo
        for b in topo.owned_blocks(st.me):
            if b not in st.owned:
                if st.replica is None or st.replica.index != b:
                    raise RuntimeFailure(f"worker {st.me} must own block {b} but holds no replica")
                self._promote(st.replica)
                st.log(f"promoted replica of block {b} (lost worker's layers) to owned")
        # a slot that came back (reconfiguration) takes its block back from its shadow
        fresh = reconfigure.demote(st, topo) or self.joining
        report: dict[str, Any] = {
            "v": {str(b): blk.version for b, blk in st.owned.items()},
            "s": {str(b): blk.stash_step for b, blk in st.owned.items()},
            "p": st.progress.step,
            "g": {str(b): st.progress.report(b).to_json() for b in st.owned},
        }
        if st.replica is not None:
            report["v"][f"r{st.replica.index}"] = st.replica.version
        if self.joining:  # holds nothing yet: its versions come from the keepers
            report = {"v": {}, "s": {}, "p": -1, "g": {}, "j": True}
        report["f"] = fresh
        self.cluster.put(f"rendezvous/{st.generation}/{st.me}", report)
        reports = self._await_reports(topo)
        joiners = sorted(w for w, rep in reports.items() if rep.get("j"))
        fresh = any(rep.get("f") for rep in reports.values())
        versions = [int(v) for rep in reports.values() for v in rep["v"].values()]
        resume, top = min(versions), max(versions)
        if top > resume + 1:
            raise RuntimeFailure(f"block versions {resume}..{top} differ by more than one step")
        for blk in [*st.owned.values(), *([st.replica] if st.replica else [])]:
            if blk.version == resume + 1 and not self.joining:
                assert blk.snapshot is not None
                blk.snapshot.restore(blk.params, blk.optimizer)
                blk.version = resume
                blk.drop_prepared()
        if fresh:
            reconfigure.restart_step(st, resume)
            tr = Transport(st.me, st.generation, st.opts.backend, self.store, st.timeout, st.device)
            # a new pipeline's keepers are in another pipeline: links for the hand-over too
            peers = set(topo.peers(st.me)) | reconfigure.handover_peers(topo, st.me, joiners)
            tr.connect(sorted(peers), st.changed)
            st.transport = tr
            st.groups = Groups(st.me, st.generation, st.opts.backend, self.store, st.group_timeout)
            reconfigure.transfer(st, topo, joiners, tr, resume)
            self.joining = False
            return resume, None
        if st.progress.step != resume:
            # what this worker holds is of another step: only stashed gradients still count
            st.progress = StepProgress(resume)
            for b, blk in st.owned.items():
                st.progress.accumulated[b] = set(range(st.M)) if blk.stash_step == resume else set()
                if blk.stash_step != resume:
                    blk.fresh_acc(1 if b == st.P - 1 else 0)
        progress = {
            b: self._reported_progress(reports[topo.owner(st.pipe, b)], b, resume)
            for b in range(st.P)
        }
        rest = recovery_plan(st.P, st.M, progress)
        tr = Transport(
            st.me,
            st.generation,
            st.opts.backend,
            self.store,
            st.timeout,
            st.device,
            st.opts.address,
        )
        tr.connect(topo.peers(st.me), st.changed)
        st.transport = tr
        st.groups = Groups(
            st.me,
            st.generation,
            st.opts.backend,
            self.store,
            st.group_timeout,
            st.opts.address,
        )
        return resume, rest

    def _reported_progress(self, report: dict[str, Any], block: int, resume: int) -> BlockProgress:
        """A block's progress for step ``resume``, as every worker of the pipeline reads it."""
        M = self.state.M
        stashed = int(report["s"][str(block)]) == resume
        if int(report["p"]) != resume:
            return BlockProgress.complete(M) if stashed else BlockProgress()
        got = BlockProgress.from_json(report["g"][str(block)])
        if stashed:
            got = BlockProgress(frozenset(range(M)), got.graphs, got.outputs, got.input_grads)
        return got

    def _promote(self, rep: BlockState) -> None:
        """Own the replica: same module, optimizer and version, plus its eager FRC/BRC work.

        The replica's forward graphs of the current step become the block's graphs (the
        recovery plan then runs only their backward: lazy BRC), eager-BRC gradients are
        accumulated at once; nothing of the victim's own accumulation survives.
        """
        st = self.state
        k = rep.index
        st.owned[k] = rep
        st.replica = None
        rep.stash_step = -1
        rep.fresh_acc(1 if k == st.P - 1 else 0)
        with st.lock:
            prog = st.progress
            done = prog.accumulated.setdefault(k, set())
            done.clear()
            for (idx, m), rec in sorted(st.frc.items()):
                if idx != k or rec.step != prog.step or rec.version != rec.step:
                    continue
                if rec.brc_param_grads is not None:
                    for acc, g in zip(rep.acc, rec.brc_param_grads, strict=True):
                        acc.add_(g)
                    done.add(m)
                    if rec.brc_input_grad is not None:
                        prog.input_grads[(k, m)] = rec.brc_input_grad
                elif not rec.consumed:
                    prog.graphs[(k, m)] = (rec.inp, rec.out)
                if k == st.P - 1:
                    prog.losses[m] = float(rec.out.item())
                else:
                    prog.outputs[(k, m)] = rec.out.detach()

    def _await_reports(self, topo: Topology) -> dict[int, dict[str, Any]]:
        st = self.state

        def collect() -> dict[int, dict[str, Any]]:
            while True:
                got = self.cluster.get_prefix(f"rendezvous/{st.generation}/")
                reports = {int(k.rsplit("/", 1)[1]): v for k, v in got.items()}
                if all(w in reports for w in topo.alive):
                    return reports
                if st.changed.is_set():
                    raise Interrupted("generation moved during rendezvous")
                time.sleep(st.opts.poll_s)

        return interruptible(collect, st.changed, f"rendezvous of generation {st.generation}")
