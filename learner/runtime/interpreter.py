"""The instruction interpreter: runs one block's program of a step, with eager FRC/BRC.

Each block the worker owns runs its instruction list (``schedule``) on its own pool
thread (submitted by the step loop, ``engine``; ``comm.POOL`` keeps the threads); blocks on the same worker (after a failover) hand
each other activations and gradients through the transport's local mailbox instead of
the network. Gradients are computed with ``torch.autograd.grad`` and added to a per-block
accumulator under the worker lock with an epoch check, so a thread abandoned by a
failover (still blocked in gloo, see ``comm``) can never touch the step that replaced it.

Redundant computation: the block whose successor this worker shadows runs the replica's
forward (eager FRC) as filler while a receive is in flight, where ``BubblePredictor``
says it fits (the last stage takes its pipeline-fill wait as at least as long as the
schedule's FRC plan, ``schedule.frc_plan``, says); what is left runs in the sync phase
while the replica's update is awaited. Eager BRC runs the replica's backward where the
schedule puts ``Op.BRC``. ``frc_profile`` records where each FRC ran: FRC time before
the awaited message arrived counts as in a bubble, time past it as an overrun.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from learner.runtime.api import LinkError, RuntimeFailure
from learner.runtime.bubbles import (
    FOR_BRC,
    IN_BUBBLE,
    IN_SYNC,
    OVERRUN,
    BubblePredictor,
    FrcProfile,
)
from learner.runtime.comm import ACT, BRC_GRAD, GRAD, BackgroundCall, tag
from learner.runtime.schedule import Instr, Op, frc_plan
from learner.runtime.worker_state import FrcRecord, WorkerState

# the phase of a step (``WorkerState.phase``) each instruction's time goes to; receives
# record their own (their wait, and the eager FRC that filled it)
_PHASE = {
    Op.LOAD: "load",
    Op.FORWARD: "forward",
    Op.SEND_ACT: "send_post",
    Op.SEND_GRAD: "send_post",
    Op.BACKWARD: "backward",
    Op.BRC: "brc",
}
_TIMED_INSIDE = frozenset({Op.RECV_ACT, Op.RECV_GRAD})


class Interpreter:
    """Runs blocks' instruction lists for one worker; owns the bubble predictions."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        # a leftover FRC is free only on the last stage (see bubbles)
        self._bubbles = BubblePredictor(overrun=0.1 if state.me % state.P == state.P - 1 else 0.5)
        self.frc_profile = FrcProfile()
        # Fill every planned wait with exactly its planned FRC (the plan as floor and cap)
        # instead of as the predictor says. Off: on the loaded 2-core machine it measured
        # slower than the predictor alone (benchmarks/RESULTS.md, rz-eager-plan-capped).
        self.cap_to_plan = False
        # FRC plans by (block, stages, microbatches): computed once, not every step
        self._plans: dict[tuple[int, int, int], dict[int, int]] = {}

    def _plan(self, b: int) -> dict[int, int]:
        """{index of a receive in block ``b``'s pipeline part: FRC forwards planned there}."""
        st = self.state
        key = (b, st.P, st.M)
        if key not in self._plans:
            self._plans[key] = frc_plan(st.P, st.M, st.job.schedule, st.mode.eager_brc)[b]
        return self._plans[key]

    def run_block(
        self, b: int, step: int, epoch: int, program: list[Instr], recovering: bool
    ) -> None:
        """Run ``program`` for owned block ``b``; ``recovering``: it is a failover's rest."""
        st = self.state
        blk = st.owned[b]
        tr = st.transport
        assert tr is not None
        topo = st.topo
        prog = st.progress
        last, first = b == st.P - 1, b == 0
        scale = 1.0 / (st.M * st.D)
        inputs: dict[int, torch.Tensor] = {}
        out_grads: dict[int, torch.Tensor] = {}
        sends: list[Any] = []
        # the block whose successor this worker shadows runs eager FRC in its waits
        filling = (
            not recovering and st.mode.eager_frc and st.replica is not None and b == st.me % st.P
        )
        plan = self._plan(b) if filling else {}
        t_block = time.monotonic()
        for idx, ins in enumerate(program):
            st.check_kill(ins.op, ins.microbatch)
            st.guard(epoch)
            m = ins.microbatch
            t_op = time.monotonic()
            if ins.op is Op.LOAD:
                st.batch(step, m)  # prefetch
            elif ins.op is Op.RECV_ACT:
                src = topo.owner(st.pipe, b - 1)
                inputs[m] = self._recv(
                    (b, idx),
                    filling,
                    step,
                    epoch,
                    plan.get(idx, 0),
                    lambda src=src, m=m: tr.recv(  # type: ignore[misc]
                        src, tag(ACT, b - 1, step, m), st.act_shapes[b - 1], st.act_dtype
                    ),
                )
            elif ins.op is Op.FORWARD:
                inp = st.batch(step, m)[0] if first else inputs.pop(m).requires_grad_(True)
                out = blk.module(inp)
                if last:
                    out = st.job.loss_fn(out, st.batch(step, m)[1]) * scale
                with st.lock:
                    st.guard(epoch)
                    prog.graphs[(b, m)] = (inp, out)
                    if last:
                        prog.losses[m] = float(out.item())
                    else:
                        prog.outputs[(b, m)] = out.detach()
            elif ins.op is Op.SEND_ACT:
                dst = topo.owner(st.pipe, b + 1)
                sends.append(tr.send(dst, tag(ACT, b, step, m), prog.outputs[(b, m)]))
            elif ins.op is Op.RECV_GRAD:
                src = topo.owner(st.pipe, b + 1)
                g = self._recv(
                    (b, idx),
                    filling,
                    step,
                    epoch,
                    plan.get(idx, 0),
                    lambda src=src, m=m: tr.recv(  # type: ignore[misc]
                        src, tag(GRAD, b + 1, step, m), st.act_shapes[b], st.act_dtype
                    ),
                )
                out_grads[m] = g
                holder = topo.replica_holder(st.pipe, b)
                if st.mode.eager_brc and not recovering and holder is not None and holder != st.me:
                    sends.append(tr.send(holder, tag(BRC_GRAD, b, step, m), g))
            elif ins.op is Op.BACKWARD:
                with st.lock:
                    st.guard(epoch)
                    # popped before use: autograd frees the graph, and a thread abandoned
                    # mid-backward must leave the rendezvous a truthful report
                    graph = prog.graphs.pop((b, m), None)
                    accumulate = m not in prog.accumulated.setdefault(b, set())
                if graph is None:
                    raise RuntimeFailure(f"block {b}: no forward graph for microbatch {m}")
                inp, out = graph
                targets = [inp] if inp.requires_grad else []
                # a pass-through backward (already accumulated) only feeds its predecessor
                wrt = targets + (blk.params if accumulate else [])
                grads = torch.autograd.grad(
                    out,
                    wrt,
                    grad_outputs=None if last else out_grads.pop(m),
                    allow_unused=True,
                )
                with st.lock:
                    st.guard(epoch)
                    if accumulate and m not in prog.accumulated[b]:
                        # one foreach call, not an add_ per parameter (the same adds)
                        pairs = [
                            (acc, pg)
                            for acc, pg in zip(blk.acc, grads[len(targets) :], strict=True)
                            if pg is not None
                        ]
                        if pairs:
                            torch._foreach_add_([a for a, _ in pairs], [g for _, g in pairs])
                        prog.accumulated[b].add(m)
                    if targets:
                        prog.input_grads[(b, m)] = grads[0]
            elif ins.op is Op.SEND_GRAD:
                dst = topo.owner(st.pipe, b - 1)
                sends.append(tr.send(dst, tag(GRAD, b, step, m), prog.input_grads[(b, m)]))
            elif ins.op is Op.BRC:
                self._brc_backward(step, m, epoch)
            if ins.op not in _TIMED_INSIDE:
                st.phase(step, _PHASE.get(ins.op, "other"), time.monotonic() - t_op)
        t_wait = time.monotonic()
        for work in sends:
            if work is not None:
                try:
                    work.wait()
                except RuntimeError as exc:
                    raise LinkError(-1, str(exc).splitlines()[0].split(". ")[0]) from exc
        st.phase(step, "send_wait", time.monotonic() - t_wait)
        st.phase(step, "block", time.monotonic() - t_block)

    def leftover_frc(self, step: int, awaited: BackgroundCall[Any] | None = None) -> None:
        """Eager FRC that found no bubble in the pipeline part (run by the sync phase).

        ``awaited``: the receive of the replica's update, already posted. Until it arrives
        the worker has nothing else to do (the last stage's cool-down bubble: it waits for
        its predecessors' last backwards), so FRC time before its arrival counts as in a
        bubble; FRC after it is on the critical path (``IN_SYNC``).
        """
        epoch = self.state.epoch
        while (m := self._next_frc(step)) is not None:
            if awaited is None or awaited.done.is_set():
                self._ensure_frc(step, m, epoch, IN_SYNC)
            else:
                span = self._ensure_frc(step, m, epoch, None)
                if span is not None:
                    self._attribute(step, span, awaited, IN_SYNC)

    def _recv(
        self,
        key: tuple[int, int],
        filling: bool,
        step: int,
        epoch: int,
        planned: int,
        receive: Callable[[], torch.Tensor],
    ) -> torch.Tensor:
        """``receive()``, running pending eager FRC while it is in flight, each only if it
        is predicted to end in time. The last stage takes its planned pipeline-fill wait
        (``planned`` FRC forwards, ``schedule.frc_plan``) as at least that long whatever it
        measured: arriving late one step would else stop it filling it again. With
        ``cap_to_plan`` every planned wait is taken as at least ``planned`` long and gets
        no more than that.

        Filling stops once the message is there; what an FRC ran past its arrival is
        recorded as ``OVERRUN``.
        """
        bubbles = self._bubbles
        st = self.state
        floor = planned if (self.cap_to_plan or st.me % st.P == st.P - 1) else 0
        cap = planned if self.cap_to_plan else 0
        t0 = time.monotonic()
        if not (filling and bubbles.fits(key, 0.0, floor) and self._next_frc(step) is not None):
            # a wait: the replica's update may be applied meanwhile (replica_update)
            with st.updater.idle():
                got = receive()
            waited = time.monotonic() - t0
            bubbles.record_wait(key, waited)
            st.phase(step, "recv_wait", waited)
            return got
        call = BackgroundCall(receive, f"recv-{key}")
        spans: list[tuple[float, float]] = []
        while not call.done.is_set():
            m = self._next_frc(step)
            if m is None or (cap and len(spans) >= cap):
                break
            if not bubbles.fits(key, time.monotonic() - t0, floor):
                break
            span = self._ensure_frc(step, m, epoch, None)
            if span is not None:
                spans.append(span)
        with st.updater.idle():
            call.done.wait()
        filled = 0.0
        for span in spans:
            self._attribute(step, span, call, OVERRUN)
            filled += span[1] - span[0]
        st.phase(step, "frc", filled)
        st.phase(step, "recv_wait", time.monotonic() - t0 - filled)
        # arrival measured in the receiving thread: filling does not shrink the prediction
        bubbles.record_wait(key, call.finished_at - t0)
        return call.result()

    def _attribute(
        self, step: int, span: tuple[float, float], awaited: BackgroundCall[Any], late: str
    ) -> None:
        """Record an FRC that ran over ``span`` while ``awaited`` was in flight: in a bubble
        up to the message's arrival, ``late`` for whatever ran past it. Never waits: a
        message still not there arrives after the span."""
        t0, t1 = span
        arrived = awaited.finished_at if awaited.done.is_set() else t1
        inside = max(0.0, min(t1, arrived) - t0)
        self.frc_profile.record(step, IN_BUBBLE, inside)
        if t1 - t0 > inside:
            self.frc_profile.record(step, late, t1 - t0 - inside)

    def _next_frc(self, step: int) -> int | None:
        """The first microbatch whose eager FRC is still to run and can run now."""
        st = self.state
        rep = st.replica
        if rep is None:
            return None
        k = rep.index
        with st.lock:
            for m in range(st.M):
                rec = st.frc.get((k, m))
                if rec is not None and rec.step == step:
                    continue
                if k == 0 or (k - 1, m) in st.progress.outputs:
                    return m
                return None  # inputs come in microbatch order
        return None

    def _frc_ctx(self) -> contextlib.AbstractContextManager[Any]:
        # On a GPU the replica's saved activations go to (pinned) host memory (Bamboo §4.1).
        if self.state.device.type == "cuda":
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
        return contextlib.nullcontext()

    def _ensure_frc(
        self, step: int, m: int, epoch: int, where: str | None
    ) -> tuple[float, float] | None:
        """The replica's forward of microbatch ``m`` (eager FRC), unless it already ran.

        Recorded in ``frc_profile`` under ``where``; with None the caller records it (from
        the returned start and end), once it knows when the awaited message arrived.
        """
        st = self.state
        rep = st.replica
        assert rep is not None
        k = rep.index
        with st.lock:
            rec = st.frc.get((k, m))
            if rec is not None and rec.step == step:
                return None
        # the replica's forward is of this step's version: its update of the previous step,
        # applied on the updater's thread since, must be in
        st.settle_replica()
        st.check_kill(Op.FRC, m)
        t0 = time.monotonic()
        if k == 0:
            inp = st.batch(step, m)[0]
        else:
            with st.lock:
                inp = st.progress.outputs[(k - 1, m)].detach().clone().requires_grad_(True)
        with self._frc_ctx():
            out = rep.module(inp)
            if k == st.P - 1:
                out = st.job.loss_fn(out, st.batch(step, m)[1]) * (1.0 / (st.M * st.D))
        with st.lock:
            st.guard(epoch)
            st.frc[(k, m)] = FrcRecord(step, rep.version, inp, out)
        t1 = time.monotonic()
        self._bubbles.record_frc(t1 - t0)
        if where is not None:
            self.frc_profile.record(step, where, t1 - t0)
        return t0, t1

    def _brc_backward(self, step: int, m: int, epoch: int) -> None:
        st = self.state
        rep = st.replica
        tr = st.transport
        assert rep is not None and tr is not None
        k = rep.index
        self._ensure_frc(step, m, epoch, FOR_BRC)
        with st.lock:
            st.guard(epoch)
            rec = st.frc[(k, m)]
            rec.consumed = True
        g = None
        if k != st.P - 1:
            g = tr.recv(
                st.topo.owner(st.pipe, k),
                tag(BRC_GRAD, k, step, m),
                st.act_shapes[k],
                st.act_dtype,
            )
        targets = [rec.inp] if rec.inp.requires_grad else []
        grads = torch.autograd.grad(
            rec.out, targets + rep.params, grad_outputs=g, allow_unused=True
        )
        with st.lock:
            st.guard(epoch)
            rec.brc_input_grad = grads[0] if targets else None
            rec.brc_param_grads = [
                torch.zeros_like(p) if gr is None else gr
                for p, gr in zip(rep.params, grads[len(targets) :], strict=True)
            ]
