"""One pipeline worker: its blocks, the schedule interpreter, the sync phase and failover.

How a step runs. Each block the worker owns runs its instruction list (``schedule``)
in its own thread; blocks on the same worker (after a failover) hand each other
activations and gradients through the transport's local mailbox instead of the network.
Gradients are computed with ``torch.autograd.grad`` and added to a per-block accumulator
under the worker lock with an epoch check, so a thread abandoned by a failover (still
blocked in gloo, see ``comm``) can never touch the step that replaced it. Then the sync
phase: per owned block, in block order, the local gradients are stashed, all-reduced
across pipelines (on a copy), a snapshot of parameters and optimizer state is taken and
the optimizer steps; the reduced gradients go to the block's replica holder, which
applies the same update, so replica and original stay bit-identical.

Failover (ARCHITECTURE §5). A link error, or a lease that expired, makes a worker
declare the peer dead with a compare-and-set on the cluster state: generation ``g+1``.
Every survivor then joins ``g+1``: the shadow promotes its replica (parameters,
optimizer state, version, and the eager-FRC results of the interrupted step) to an owned
block and so runs the victim's work next to its own — victim↔shadow messages become
local hand-offs, neighbours are rerouted to the shadow. Survivors report per-block
versions at the rendezvous; the step to resume is the lowest version (blocks one step
ahead roll back from their snapshot, which is exact). The step is not restarted: what
every worker still holds of it (``StepProgress``: accumulated microbatches, kept forward
graphs, outputs and input gradients) goes into the report too, and ``recovery.plan``
turns the reports into what is left — for the victim's block, the backward over its
eager-FRC graphs of the microbatches it had already finished (lazy BRC, only for those),
then the victim's remaining forwards and backwards; messages lost with the old links
are resent from what the senders kept. A pipeline that lost nobody and had finished its
microbatches only re-runs the all-reduce. Every pipeline keeps its microbatches, so the
global batch is unchanged and the result equals an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from learner.runtime import schedule as sched
from learner.runtime.api import (
    Batch,
    ConfigError,
    Evicted,
    FatalFailure,
    Interrupted,
    LinkError,
    PipelineJob,
    RuntimeFailure,
)
from learner.runtime.bubbles import BubblePredictor
from learner.runtime.cluster_state import ClusterState, ClusterStateStore, initial_state
from learner.runtime.comm import (
    ACT,
    BRC_GRAD,
    GRAD,
    SYNC,
    BackgroundCall,
    Groups,
    Transport,
    interruptible,
    tag,
)
from learner.runtime.partition import balanced_boundaries, param_costs, profile_costs
from learner.runtime.recovery import BlockProgress, RecoveryPlan
from learner.runtime.recovery import plan as recovery_plan
from learner.runtime.schedule import Instr, Op
from learner.runtime.snapshot import OptimizerSnapshot
from learner.runtime.topology import Topology

# torch.manual_seed is process-global; in-process runs build several workers at once.
_SEED_LOCK = threading.Lock()


@dataclass(frozen=True)
class KillPoint:
    """Make ``worker`` SIGKILL itself before ``op`` of ``microbatch`` (-1: any) at ``step``."""

    worker: int
    step: int
    op: str
    microbatch: int = -1

    @classmethod
    def parse(cls, spec: str) -> list[KillPoint]:
        out = []
        for part in filter(None, spec.split(",")):
            fields = part.split(":")
            if len(fields) not in (3, 4):
                raise ConfigError(
                    f"kill point {part!r}: expected worker:step:op[:microbatch], e.g. 1:2:forward:0"
                )
            if fields[2] not in {o.value for o in Op}:
                raise ConfigError(
                    f"kill point {part!r}: op {fields[2]!r} is unknown; use one of "
                    f"{', '.join(o.value for o in Op)}"
                )
            m = int(fields[3]) if len(fields) == 4 else -1
            out.append(cls(int(fields[0]), int(fields[1]), fields[2], m))
        return out


@dataclass
class WorkerOptions:
    worker: int
    stages: int
    pipelines: int
    backend: str = "gloo"
    device: str = "cpu"
    detection_timeout_s: float = 5.0
    lease_ttl_s: float = 2.0
    poll_s: float = 0.05
    out_dir: str | None = None
    kill: list[KillPoint] = field(default_factory=list)
    verbose: bool = True
    startup_timeout_s: float = 120.0


@dataclass
class BlockState:
    index: int
    module: nn.Module
    optimizer: torch.optim.Optimizer
    version: int = 0
    snapshot: OptimizerSnapshot | None = None
    acc: list[torch.Tensor] = field(default_factory=list)
    stash_step: int = -1
    stash: torch.Tensor | None = None

    @property
    def params(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


@dataclass
class StepProgress:
    """What this worker holds of one step's pipeline work; it outlives a failover.

    Everything is written under the worker lock after an epoch check, so a thread
    abandoned by a failover cannot change it once the rendezvous has read it.
    """

    step: int
    accumulated: dict[int, set[int]] = field(default_factory=dict)
    graphs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    input_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)

    def report(self, block: int) -> BlockProgress:
        def mbs(keys: Any) -> frozenset[int]:
            return frozenset(m for b, m in keys if b == block)

        return BlockProgress(
            frozenset(self.accumulated.get(block, ())),
            mbs(self.graphs),
            mbs(self.outputs),
            mbs(self.input_grads),
        )


@dataclass
class FrcRecord:
    step: int
    version: int
    inp: torch.Tensor
    out: torch.Tensor
    brc_param_grads: list[torch.Tensor] | None = None
    brc_input_grad: torch.Tensor | None = None
    # an eager BRC has started on the graph (autograd frees it): not reusable as a graph
    consumed: bool = False


class Worker:
    """A pipeline stage process (or thread, in-process) of one job."""

    def __init__(
        self,
        job: PipelineJob,
        opts: WorkerOptions,
        cluster: ClusterStateStore,
        store: dist.Store,
    ) -> None:
        job.validate(opts.stages)
        if opts.pipelines < 1:
            raise ConfigError(f"pipelines={opts.pipelines}: must be >= 1")
        if not 0 <= opts.worker < opts.stages * opts.pipelines:
            raise ConfigError(
                f"worker {opts.worker} is outside 0..{opts.stages * opts.pipelines - 1} "
                f"for {opts.stages} stages x {opts.pipelines} pipelines"
            )
        self.job = job
        self.opts = opts
        self.cluster = cluster
        self.store = store
        self.me = opts.worker
        self.P, self.D, self.M = opts.stages, opts.pipelines, job.microbatches
        self.pipe = self.me // self.P
        self.device = torch.device(opts.device)
        self.mode = job.redundancy
        self.timeout = timedelta(seconds=opts.detection_timeout_s)
        # all-reduce peers may legitimately wait for another pipeline's failover
        self.group_timeout = timedelta(seconds=max(4 * opts.detection_timeout_s, 20.0))
        self._lock = threading.RLock()
        self._epoch = 0
        self._changed = threading.Event()
        self._stopped = threading.Event()
        self._members_complete = threading.Event()
        self.generation = 0
        self.topo = Topology(self.P, self.D, frozenset(), self.mode.has_replica)
        self.owned: dict[int, BlockState] = {}
        self.replica: BlockState | None = None
        self._frc: dict[tuple[int, int], FrcRecord] = {}
        self._progress = StepProgress(-1)
        # a leftover FRC is free only on the last stage (see bubbles)
        self._replica_update: tuple[torch.Tensor, int] | None = None
        self._bubbles = BubblePredictor(overrun=0.1 if self.me % self.P == self.P - 1 else 0.5)
        self._batches: dict[tuple[int, int], Batch] = {}
        self._graveyard: list[Any] = []
        self.step = 0
        self.loss_history: list[tuple[int, float]] = []
        # (step, seconds since the previous step ended): failover pauses land in here
        self.step_times: list[tuple[int, float]] = []
        self._t_last = time.monotonic()
        self.events: list[str] = []
        self._transport: Transport | None = None
        self._groups: Groups | None = None

    # ------------------------------------------------------------------ setup

    def _log(self, msg: str) -> None:
        self.events.append(msg)
        if self.opts.verbose:
            print(f"[worker {self.me}] {msg}", file=sys.stderr, flush=True)

    def _build(self) -> None:
        with _SEED_LOCK:
            torch.manual_seed(self.job.seed)
            layers = [layer.to(dtype=self.job.dtype) for layer in self.job.build_layers()]
        self.boundaries = self._partition(layers)
        self.layer_count = len(layers)
        blocks = [
            nn.Sequential(*layers[a:b]).to(self.device)
            for a, b in zip(self.boundaries, self.boundaries[1:], strict=False)
        ]
        # shapes of block outputs, so a receiver can allocate before the message comes
        x, _ = self._batch(0, 0)
        self.act_shapes: list[torch.Size] = []
        with torch.no_grad():
            for block in blocks:
                x = block(x)
                self.act_shapes.append(x.shape)
        self.act_dtypes = self.job.dtype
        my_block = self.me % self.P
        self.owned = {my_block: self._block_state(my_block, blocks[my_block])}
        rep = self.topo.replica_block(self.me)
        if rep is not None:
            self.replica = self._block_state(rep, blocks[rep])

    def _block_state(self, index: int, module: nn.Module) -> BlockState:
        return BlockState(index, module, self.job.optimizer(module.parameters()))

    def _partition(self, layers: list[nn.Module]) -> list[int]:
        if self.job.balance == "params":
            return balanced_boundaries(param_costs(layers), self.P)
        # profiled times differ between processes: one worker decides for everybody
        if self.me == 0:
            x, _ = self.job.batch(0, 0, 0)
            costs = profile_costs(layers, x.to(dtype=self.job.dtype))
            bounds = balanced_boundaries(costs, self.P)
            self.cluster.put("partition", {"boundaries": bounds})
            return bounds
        deadline = time.monotonic() + self.opts.startup_timeout_s
        while time.monotonic() < deadline:
            got = self.cluster.get("partition")
            if got is not None:
                return [int(b) for b in got["boundaries"]]
            time.sleep(self.opts.poll_s)
        raise RuntimeFailure("worker 0 never published the partition")

    def _start(self) -> None:
        self.cluster.register(self.me, self.opts.lease_ttl_s)
        # keep the lease from the first moment: the first torch calls of a fresh process
        # can take longer than a short lease
        self._watcher = threading.Thread(target=self._watch, name="watcher", daemon=True)
        self._watcher.start()
        state = initial_state(self.cluster, self.P, self.D)
        if state.generation != 0:
            raise ConfigError(
                f"job already at generation {state.generation}: a worker cannot join a running "
                "job before reconfiguration is supported; use a fresh job id"
            )
        deadline = time.monotonic() + self.opts.startup_timeout_s
        while len(self.cluster.alive_members()) < self.P * self.D:
            if time.monotonic() > deadline:
                raise RuntimeFailure(
                    f"only {len(self.cluster.alive_members())} of {self.P * self.D} workers "
                    f"registered within {self.opts.startup_timeout_s:.0f} s"
                )
            time.sleep(self.opts.poll_s)
        self._members_complete.set()
        t0 = time.monotonic()
        self._build()
        t1 = time.monotonic()
        self._transport = Transport(
            self.me, 0, self.opts.backend, self.store, self.timeout, self.device
        )
        self._transport.connect(self.topo.peers(self.me), self._changed)
        self._groups = Groups(self.me, 0, self.opts.backend, self.store, self.group_timeout)
        self._t_last = time.monotonic()
        self._log(
            f"started: layers {self.boundaries}, built in {t1 - t0:.2f} s, "
            f"links in {time.monotonic() - t1:.2f} s"
        )

    # ---------------------------------------------------------------- watcher

    def _watch(self) -> None:
        last_keepalive = 0.0
        while not self._stopped.is_set():
            try:
                now = time.monotonic()
                if now - last_keepalive > self.opts.lease_ttl_s / 4:
                    self.cluster.keepalive()
                    last_keepalive = now
                state, _ = self.cluster.get_state()
                if state is not None and self._members_complete.is_set():
                    if state.generation != self.generation or state.fatal or self.me in state.dead:
                        self._changed.set()
                    alive = self.cluster.alive_members()
                    missing = [
                        w
                        for w in Topology(self.P, self.D, frozenset(state.dead)).alive
                        if w not in alive and w != self.me
                    ]
                    if missing:
                        # a worker that finished the job lets its lease go: not a failure
                        done = {
                            int(k.rsplit("/", 1)[1])
                            for k in self.cluster.get_prefix(f"done/{state.generation}/")
                        }
                        for w in missing:
                            if w not in done:
                                self._declare_dead(w, "etcd lease expired")
            except Exception as exc:  # a flaky etcd read must not kill the watcher
                self._log(f"watcher: {exc!r}")
            self._stopped.wait(self.opts.poll_s)

    def _declare_dead(self, suspect: int, reason: str) -> None:
        self.cluster.record_failure(self.me, suspect, reason, self.step)
        while True:
            state, token = self.cluster.get_state()
            assert state is not None
            if suspect in state.dead or state.fatal:
                return
            topo = Topology(
                self.P, self.D, frozenset(state.dead) | {suspect}, self.mode.has_replica
            )
            fatal, fpipe, fstages = topo.fatal_info()
            new = state.bump(
                dead=tuple(sorted(topo.dead)),
                fatal=fatal,
                fatal_pipeline=fpipe,
                fatal_stages=fstages,
            )
            if self.cluster.set_state(new, token):
                self._log(
                    f"declared worker {suspect} dead ({reason}) -> generation {new.generation}"
                    + (f"; FATAL: {fatal}" if fatal else "")
                )
                self._changed.set()
                return

    # ------------------------------------------------------------- main loop

    def run(self) -> dict[str, torch.Tensor]:
        """Train ``job.steps`` steps; returns the parameters of the blocks this worker owns."""
        try:
            self._start()
            # None: a fresh step; else what a failover left of the step, per owned block
            rest: dict[int, list[Instr]] | None = None
            step = 0
            while True:
                self.step = step
                try:
                    if step >= self.job.steps:
                        self._finish()
                        return self.params()
                    self._compute(step, rest)
                    self._sync(step)
                    step += 1
                    rest = None
                except (Interrupted, LinkError) as exc:
                    self._log(f"step {step}: {exc}")
                    if isinstance(exc, LinkError):
                        self._on_link_error(exc)
                    step, rest = self._failover()
        except FatalFailure as exc:
            if self.job.on_fatal is not None:
                self.job.on_fatal(exc)
            raise
        finally:
            self._stopped.set()
            if self._transport is not None:
                self._transport.close()

    def params(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for b, blk in self.owned.items():
            start = self.boundaries[b]
            for name, tensor in blk.module.state_dict().items():
                local, _, rest = name.partition(".")
                out[f"{start + int(local)}.{rest}"] = tensor.detach().cpu().clone()
        return out

    def _check_kill(self, op: Op | str, microbatch: int = -1) -> None:
        # any generation: with two kill points the second may be reached only after the
        # first loss was handled, while resuming the same step
        for k in self.opts.kill:
            if (
                k.worker == self.me
                and k.step == self.step
                and k.op == str(op)
                and k.microbatch in (-1, microbatch)
            ):
                print(
                    f"[worker {self.me}] SIGKILL self at step {self.step} {op}({microbatch})",
                    file=sys.stderr,
                    flush=True,
                )
                os.kill(os.getpid(), signal.SIGKILL)

    # ----------------------------------------------------------- compute phase

    def _batch(self, step: int, microbatch: int) -> Batch:
        key = (step, microbatch)
        with self._lock:
            got = self._batches.get(key)
        if got is None:
            x, y = self.job.batch(step, self.pipe, microbatch)
            if x.is_floating_point():
                x = x.to(dtype=self.job.dtype)
            got = (x.to(self.device), y.to(self.device))
            with self._lock:
                self._batches[key] = got
        return got

    def _compute(self, step: int, rest: dict[int, list[Instr]] | None) -> None:
        """Run the step's pipeline part: the full schedule, or ``rest`` after a failover."""
        recovering = rest is not None
        with self._lock:
            epoch = self._epoch
            if rest is None:
                self._batches = {k: v for k, v in self._batches.items() if k[0] >= step}
                self._frc = {k: r for k, r in self._frc.items() if r.step == step}
                self._progress = StepProgress(step, {b: set() for b in self.owned})
                for blk in self.owned.values():
                    blk.acc = [torch.zeros_like(p) for p in blk.params]
                rest = {b: self._program(b) for b in self.owned}
        programs = {b: prog for b, prog in rest.items() if prog}
        results: queue.Queue[tuple[int, BaseException | None]] = queue.Queue()
        for b in sorted(programs):
            threading.Thread(
                target=self._run_block_thread,
                args=(b, step, epoch, programs[b], recovering, results),
                name=f"block{b}-step{step}",
                daemon=True,
            ).start()
        pending = set(programs)
        while pending:
            try:
                b, err = results.get(timeout=0.02)
            except queue.Empty:
                if self._changed.is_set():
                    raise Interrupted(f"generation changed during step {step}") from None
                continue
            pending.discard(b)
            if err is not None:
                raise err

    def _on_link_error(self, err: LinkError) -> None:
        if self._changed.is_set() or err.peer < 0:
            return
        self._declare_dead(err.peer, err.reason)

    def _run_block_thread(
        self,
        b: int,
        step: int,
        epoch: int,
        program: list[Instr],
        recovering: bool,
        results: queue.Queue[tuple[int, BaseException | None]],
    ) -> None:
        try:
            self._run_block(b, step, epoch, program, recovering)
            results.put((b, None))
        except BaseException as exc:
            results.put((b, exc))

    def _program(self, b: int) -> list[Instr]:
        rep = self.replica.index if (self.replica is not None and b == (self.me % self.P)) else None
        return sched.pipeline_part(
            sched.build(
                b,
                self.P,
                self.M,
                self.job.schedule,
                replica=rep,
                eager_brc=self.mode.eager_brc,
            )
        )

    def _guard(self, epoch: int) -> None:
        if epoch != self._epoch:
            raise Interrupted("abandoned by a failover")

    def _frc_ctx(self) -> contextlib.AbstractContextManager[Any]:
        # On a GPU the replica's saved activations go to (pinned) host memory (Bamboo §4.1).
        if self.device.type == "cuda":
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
        return contextlib.nullcontext()

    def _run_block(
        self, b: int, step: int, epoch: int, program: list[Instr], recovering: bool
    ) -> None:
        blk = self.owned[b]
        tr = self._transport
        assert tr is not None
        topo = self.topo
        prog = self._progress
        last, first = b == self.P - 1, b == 0
        scale = 1.0 / (self.M * self.D)
        inputs: dict[int, torch.Tensor] = {}
        out_grads: dict[int, torch.Tensor] = {}
        sends: list[Any] = []
        # the block whose successor this worker shadows runs eager FRC in its waits
        filling = (
            not recovering
            and self.mode.eager_frc
            and self.replica is not None
            and b == self.me % self.P
        )
        for idx, ins in enumerate(program):
            self._check_kill(ins.op, ins.microbatch)
            self._guard(epoch)
            m = ins.microbatch
            if ins.op is Op.LOAD:
                self._batch(step, m)  # prefetch
            elif ins.op is Op.RECV_ACT:
                src = topo.owner(self.pipe, b - 1)
                inputs[m] = self._recv(
                    (b, idx),
                    filling,
                    step,
                    epoch,
                    b if m == 0 else 0,  # the pipeline-fill bubble: b forwards upstream
                    lambda src=src, m=m: tr.recv(  # type: ignore[misc]
                        src, tag(ACT, b - 1, step, m), self.act_shapes[b - 1], self.act_dtypes
                    ),
                )
            elif ins.op is Op.FORWARD:
                inp = self._batch(step, m)[0] if first else inputs.pop(m).requires_grad_(True)
                out = blk.module(inp)
                if last:
                    out = self.job.loss_fn(out, self._batch(step, m)[1]) * scale
                with self._lock:
                    self._guard(epoch)
                    prog.graphs[(b, m)] = (inp, out)
                    if last:
                        prog.losses[m] = float(out.item())
                    else:
                        prog.outputs[(b, m)] = out.detach()
            elif ins.op is Op.SEND_ACT:
                dst = topo.owner(self.pipe, b + 1)
                sends.append(tr.send(dst, tag(ACT, b, step, m), prog.outputs[(b, m)]))
            elif ins.op is Op.RECV_GRAD:
                src = topo.owner(self.pipe, b + 1)
                g = self._recv(
                    (b, idx),
                    filling,
                    step,
                    epoch,
                    0,
                    lambda src=src, m=m: tr.recv(  # type: ignore[misc]
                        src, tag(GRAD, b + 1, step, m), self.act_shapes[b], self.act_dtypes
                    ),
                )
                out_grads[m] = g
                holder = topo.replica_holder(self.pipe, b)
                if (
                    self.mode.eager_brc
                    and not recovering
                    and holder is not None
                    and holder != self.me
                ):
                    sends.append(tr.send(holder, tag(BRC_GRAD, b, step, m), g))
            elif ins.op is Op.BACKWARD:
                with self._lock:
                    self._guard(epoch)
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
                with self._lock:
                    self._guard(epoch)
                    if accumulate and m not in prog.accumulated[b]:
                        for acc, pg in zip(blk.acc, grads[len(targets) :], strict=True):
                            if pg is not None:
                                acc.add_(pg)
                        prog.accumulated[b].add(m)
                    if targets:
                        prog.input_grads[(b, m)] = grads[0]
            elif ins.op is Op.SEND_GRAD:
                dst = topo.owner(self.pipe, b - 1)
                sends.append(tr.send(dst, tag(GRAD, b, step, m), prog.input_grads[(b, m)]))
            elif ins.op is Op.BRC:
                self._brc_backward(step, m, epoch)
        for work in sends:
            if work is not None:
                try:
                    work.wait()
                except RuntimeError as exc:
                    raise LinkError(-1, str(exc).splitlines()[0].split(". ")[0]) from exc

    def _recv(
        self,
        key: tuple[int, int],
        filling: bool,
        step: int,
        epoch: int,
        floor_frcs: int,
        receive: Callable[[], torch.Tensor],
    ) -> torch.Tensor:
        """``receive()``, running pending eager FRC meanwhile where the wait is predicted long."""
        bubbles = self._bubbles
        t0 = time.monotonic()
        if not (
            filling and bubbles.fits(key, 0.0, floor_frcs) and self._next_frc(step) is not None
        ):
            got = receive()
            bubbles.record_wait(key, time.monotonic() - t0)
            return got
        call = BackgroundCall(receive, f"recv-{key}")
        while not call.done.is_set():
            m = self._next_frc(step)
            if m is None or not bubbles.fits(key, time.monotonic() - t0, floor_frcs):
                break
            self._ensure_frc(step, m, epoch)
        call.done.wait()
        # arrival measured in the receiving thread: filling does not shrink the prediction
        bubbles.record_wait(key, call.finished_at - t0)
        return call.result()

    def _next_frc(self, step: int) -> int | None:
        """The first microbatch whose eager FRC is still to run and can run now."""
        rep = self.replica
        if rep is None:
            return None
        k = rep.index
        with self._lock:
            for m in range(self.M):
                rec = self._frc.get((k, m))
                if rec is not None and rec.step == step:
                    continue
                if k == 0 or (k - 1, m) in self._progress.outputs:
                    return m
                return None  # inputs come in microbatch order
        return None

    def _leftover_frc(self, step: int) -> None:
        """Eager FRC that found no bubble in the pipeline part."""
        epoch = self._epoch
        while (m := self._next_frc(step)) is not None:
            self._ensure_frc(step, m, epoch)

    def _apply_replica_update(self) -> None:
        """Bring the replica to the owner's version (see ``_sync``)."""
        with self._lock:
            got, self._replica_update = self._replica_update, None
            if got is not None and self.replica is not None:
                self._apply(self.replica, got[0], got[1])

    def _ensure_frc(self, step: int, m: int, epoch: int) -> None:
        """The replica's forward of microbatch ``m`` (eager FRC), unless it already ran."""
        rep = self.replica
        assert rep is not None
        k = rep.index
        with self._lock:
            rec = self._frc.get((k, m))
            if rec is not None and rec.step == step:
                return
        self._apply_replica_update()
        self._check_kill(Op.FRC, m)
        t0 = time.monotonic()
        if k == 0:
            inp = self._batch(step, m)[0]
        else:
            with self._lock:
                inp = self._progress.outputs[(k - 1, m)].detach().clone().requires_grad_(True)
        with self._frc_ctx():
            out = rep.module(inp)
            if k == self.P - 1:
                out = self.job.loss_fn(out, self._batch(step, m)[1]) * (1.0 / (self.M * self.D))
        with self._lock:
            self._guard(epoch)
            self._frc[(k, m)] = FrcRecord(step, rep.version, inp, out)
        self._bubbles.record_frc(time.monotonic() - t0)

    def _brc_backward(self, step: int, m: int, epoch: int) -> None:
        rep = self.replica
        tr = self._transport
        assert rep is not None and tr is not None
        k = rep.index
        self._ensure_frc(step, m, epoch)
        with self._lock:
            self._guard(epoch)
            rec = self._frc[(k, m)]
            rec.consumed = True
        g = None
        if k != self.P - 1:
            g = tr.recv(
                self.topo.owner(self.pipe, k),
                tag(BRC_GRAD, k, step, m),
                self.act_shapes[k],
                self.act_dtypes,
            )
        targets = [rec.inp] if rec.inp.requires_grad else []
        grads = torch.autograd.grad(
            rec.out, targets + rep.params, grad_outputs=g, allow_unused=True
        )
        with self._lock:
            self._guard(epoch)
            rec.brc_input_grad = grads[0] if targets else None
            rec.brc_param_grads = [
                torch.zeros_like(p) if gr is None else gr
                for p, gr in zip(rep.params, grads[len(targets) :], strict=True)
            ]

    # -------------------------------------------------------------- sync phase

    def _apply(self, blk: BlockState, reduced: torch.Tensor, step: int) -> None:
        if blk.version != step:
            raise RuntimeFailure(
                f"block {blk.index} is at version {blk.version} but step {step} is being applied"
            )
        if blk.snapshot is None:
            blk.snapshot = OptimizerSnapshot()
        blk.snapshot.take(blk.params, blk.optimizer)
        offset = 0
        for p in blk.params:
            n = p.numel()
            p.grad = reduced[offset : offset + n].view_as(p).clone()
            offset += n
        blk.optimizer.step()
        blk.optimizer.zero_grad(set_to_none=True)
        blk.version = step + 1

    def _step_loss(self, step: int) -> float:
        prog = self._progress
        if prog.step != step:
            return 0.0
        return sum(prog.losses[m] for m in sorted(prog.losses))

    def _sync(self, step: int) -> None:
        tr, groups = self._transport, self._groups
        assert tr is not None and groups is not None
        sends: list[Any] = []
        loss: float | None = None
        for b in sorted(self.owned):
            blk = self.owned[b]
            if blk.stash_step != step:
                parts = [a.reshape(-1) for a in blk.acc]
                if b == self.P - 1:
                    parts.append(
                        torch.tensor(
                            [self._step_loss(step)], dtype=self.job.dtype, device=self.device
                        )
                    )
                blk.stash = torch.cat(parts) if parts else torch.zeros(0, device=self.device)
                blk.stash_step = step
            self._check_kill(Op.ALLREDUCE)
            assert blk.stash is not None
            reduced = groups.allreduce(b, self.topo.group(b), blk.stash, self._changed)
            self._check_kill(Op.OPTIMIZER)
            self._apply(blk, reduced, step)
            n = blk.numel()
            if b == self.P - 1:
                loss = float(reduced[n].item())
            holder = self.topo.replica_holder(self.pipe, b)
            if holder is not None:
                sends.append(tr.send(holder, tag(SYNC, b, step, 0), reduced[:n]))
        if self.replica is not None:
            if self.mode.eager_frc:
                # before the replica's update: FRC belongs to this step's version
                self._leftover_frc(step)
            rep = self.replica
            src = self.topo.owner(self.pipe, rep.index)
            shape = torch.Size([rep.numel()])
            reduced = interruptible(
                lambda: tr.recv(src, tag(SYNC, rep.index, step, 0), shape, self.job.dtype),
                self._changed,
                f"replica update of block {rep.index}",
            )
            # applied when the replica is next used (its FRC, in a bubble) or a failover
            # reads it: the optimizer step is off the critical path of the step's end
            self._apply_replica_update()  # the previous one, where no FRC applied it
            with self._lock:
                self._replica_update = (reduced, step)
        for work in sends:
            if work is not None:
                interruptible(work.wait, self._changed, "replica update send")
        now = time.monotonic()
        self.step_times.append((step, now - self._t_last))
        self._t_last = now
        if loss is not None:
            self.loss_history.append((step, loss))
            if self.pipe == 0 or all(
                self.topo.owner(d, self.P - 1) in self.topo.dead for d in range(self.pipe)
            ):
                print(
                    f"step {step} loss {loss:.6f} generation {self.generation} "
                    f"time {self.step_times[-1][1]:.4f}",
                    flush=True,
                )

    # ---------------------------------------------------------------- failover

    def _failover(self) -> tuple[int, dict[int, list[Instr]]]:
        t0 = time.monotonic()
        # A link error not yet turned into a new generation: wait for a detector.
        if not self._changed.wait(self.opts.detection_timeout_s + 2 * self.opts.lease_ttl_s):
            raise RuntimeFailure(
                "a link failed but no failure was declared within the detection timeout"
            )
        while True:
            try:
                step, rest = self._join()
                mine = {b: rest.programs[b] for b in self.owned}
                self._log(
                    f"joined generation {self.generation} in {time.monotonic() - t0:.3f} s: "
                    f"owns blocks {sorted(self.owned)}, resume at step {step}; "
                    f"pipeline {self.pipe}: {rest.summary()}"
                )
                return step, mine
            except Interrupted:
                continue
            except LinkError as exc:  # another loss while joining
                self._log(f"joining generation {self.generation}: {exc}")
                self._on_link_error(exc)
                if not self._changed.wait(
                    self.opts.detection_timeout_s + 2 * self.opts.lease_ttl_s
                ):
                    raise RuntimeFailure(
                        f"joining failed and no failure was declared: {exc}"
                    ) from exc

    def _read_state(self) -> ClusterState:
        state, _ = self.cluster.get_state()
        assert state is not None
        if state.fatal:
            raise FatalFailure(state.fatal, state.fatal_pipeline, state.fatal_stages)
        if self.me in state.dead:
            raise Evicted(f"worker {self.me} was declared dead by its peers")
        return state

    def _join(self) -> tuple[int, RecoveryPlan]:
        self._apply_replica_update()
        state = self._read_state()
        with self._lock:
            self._epoch += 1
            self.generation = state.generation
            self._changed.clear()
            if self._transport is not None:
                self._transport.close()
                self._graveyard.append(self._transport)
            if self._groups is not None:
                self._graveyard.append(self._groups)
        # the state may have moved again between the read and the clear
        if self._read_state().generation != self.generation:
            self._changed.set()
            raise Interrupted("generation moved during join")
        topo = Topology(self.P, self.D, frozenset(state.dead), self.mode.has_replica)
        self.topo = topo
        for b in topo.owned_blocks(self.me):
            if b not in self.owned:
                if self.replica is None or self.replica.index != b:
                    raise RuntimeFailure(
                        f"worker {self.me} must own block {b} but holds no replica"
                    )
                self._promote(self.replica)
                self._log(f"promoted replica of block {b} (lost worker's layers) to owned")
        report: dict[str, Any] = {
            "v": {str(b): blk.version for b, blk in self.owned.items()},
            "s": {str(b): blk.stash_step for b, blk in self.owned.items()},
            "p": self._progress.step,
            "g": {str(b): self._progress.report(b).to_json() for b in self.owned},
        }
        if self.replica is not None:
            report["v"][f"r{self.replica.index}"] = self.replica.version
        self.cluster.put(f"rendezvous/{self.generation}/{self.me}", report)
        reports = self._await_reports(topo)
        resume = min(int(v) for rep in reports.values() for v in rep["v"].values())
        top = max(int(v) for rep in reports.values() for v in rep["v"].values())
        if top > resume + 1:
            raise RuntimeFailure(f"block versions {resume}..{top} differ by more than one step")
        for blk in [*self.owned.values(), *([self.replica] if self.replica else [])]:
            if blk.version == resume + 1:
                assert blk.snapshot is not None
                blk.snapshot.restore(blk.params, blk.optimizer)
                blk.version = resume
        if self._progress.step != resume:
            # what this worker holds is of another step: only stashed gradients still count
            self._progress = StepProgress(resume)
            for b, blk in self.owned.items():
                self._progress.accumulated[b] = (
                    set(range(self.M)) if blk.stash_step == resume else set()
                )
                if blk.stash_step != resume:
                    blk.acc = [torch.zeros_like(p) for p in blk.params]
        progress = {
            b: self._reported_progress(reports[topo.owner(self.pipe, b)], b, resume)
            for b in range(self.P)
        }
        rest = recovery_plan(self.P, self.M, progress)
        tr = Transport(
            self.me, self.generation, self.opts.backend, self.store, self.timeout, self.device
        )
        tr.connect(topo.peers(self.me), self._changed)
        self._transport = tr
        self._groups = Groups(
            self.me, self.generation, self.opts.backend, self.store, self.group_timeout
        )
        return resume, rest

    def _reported_progress(self, report: dict[str, Any], block: int, resume: int) -> BlockProgress:
        """A block's progress for step ``resume``, as every worker of the pipeline reads it."""
        stashed = int(report["s"][str(block)]) == resume
        if int(report["p"]) != resume:
            return BlockProgress.complete(self.M) if stashed else BlockProgress()
        got = BlockProgress.from_json(report["g"][str(block)])
        if stashed:
            got = BlockProgress(frozenset(range(self.M)), got.graphs, got.outputs, got.input_grads)
        return got

    def _promote(self, rep: BlockState) -> None:
        """Own the replica: same module, optimizer and version, plus its eager FRC/BRC work.

        The replica's forward graphs of the current step become the block's graphs (the
        recovery plan then runs only their backward: lazy BRC), eager-BRC gradients are
        accumulated at once; nothing of the victim's own accumulation survives.
        """
        k = rep.index
        self.owned[k] = rep
        self.replica = None
        rep.stash_step = -1
        rep.acc = [torch.zeros_like(p) for p in rep.params]
        with self._lock:
            prog = self._progress
            done = prog.accumulated.setdefault(k, set())
            done.clear()
            for (idx, m), rec in sorted(self._frc.items()):
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
                if k == self.P - 1:
                    prog.losses[m] = float(rec.out.item())
                else:
                    prog.outputs[(k, m)] = rec.out.detach()

    def _await_reports(self, topo: Topology) -> dict[int, dict[str, Any]]:
        def collect() -> dict[int, dict[str, Any]]:
            while True:
                got = self.cluster.get_prefix(f"rendezvous/{self.generation}/")
                reports = {int(k.rsplit("/", 1)[1]): v for k, v in got.items()}
                if all(w in reports for w in topo.alive):
                    return reports
                if self._changed.is_set():
                    raise Interrupted("generation moved during rendezvous")
                time.sleep(self.opts.poll_s)

        return interruptible(collect, self._changed, f"rendezvous of generation {self.generation}")

    # ------------------------------------------------------------------ finish

    def _finish(self) -> None:
        if self.opts.out_dir:
            out = Path(self.opts.out_dir)
            out.mkdir(parents=True, exist_ok=True)
            torch.save(self.params(), out / f"worker{self.me}.pt")
        # Leave together: a worker that exits while a peer still reads from it would
        # look like a failure to that peer.
        # A failure in the last step sends everybody back (Interrupted) to redo it.
        self.cluster.put(f"done/{self.generation}/{self.me}", {"step": self.job.steps})
        deadline = time.monotonic() + 4 * self.opts.detection_timeout_s + 30
        while time.monotonic() < deadline:
            if self._changed.is_set():
                self._read_state()
                raise Interrupted("generation changed while finishing")
            done = {
                int(k.rsplit("/", 1)[1])
                for k in self.cluster.get_prefix(f"done/{self.generation}/")
            }
            if all(w in done for w in self.topo.alive):
                return
            time.sleep(self.opts.poll_s)
        self._log("some workers did not finish; leaving anyway")
