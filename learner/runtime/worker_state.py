"""What one worker holds, shared by its step loop, interpreter and failover.

``WorkerState`` is the worker's mutable state: the blocks it owns and shadows, what it
holds of the current step (``StepProgress``, eager-FRC records), the configuration it
runs in (generation, topology, links), the lock and epoch that fence threads abandoned
by a failover, and the updater that applies the replica's received updates on its own
thread (``replica_update``; readers of the replica call ``settle_replica`` first).
The step loop (``engine``), the instruction interpreter (``interpreter``) and failover
(``failover``) each keep their own state and share this one object, because all three
read and write the same blocks under the same lock.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from learner.runtime.api import Batch, Interrupted, PipelineJob, RuntimeFailure
from learner.runtime.comm import Groups, Transport, WakeableEvent
from learner.runtime.options import WorkerOptions
from learner.runtime.recovery import BlockProgress
from learner.runtime.replica_update import ReplicaUpdater
from learner.runtime.schedule import Op
from learner.runtime.snapshot import OptimizerSnapshot
from learner.runtime.topology import Topology


def prefer_foreach(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Use the optimizer's multi-tensor (``foreach``) step where the job left the choice
    to torch (``foreach=None``, which on CPU means a Python loop over the parameters).

    The same arithmetic per tensor (on CPU each foreach op runs the single-tensor op per
    tensor), so numerics do not change; what it saves is a Python call per parameter and
    operation — which matters most for the replica's update, applied on the updater
    thread beside the step loop, where every such call contends for the GIL. On CUDA
    torch already picks foreach for ``None``. A job that set ``foreach`` or ``fused``
    keeps its choice.
    """
    for group in optimizer.param_groups:
        unset = "foreach" in group and group["foreach"] is None
        if unset and not group.get("fused") and not group.get("differentiable"):
            group["foreach"] = True
    return optimizer


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
    # the step's gradients, one flat buffer kept between steps: the parameters' .grad are
    # views of it (one copy a step instead of a clone per parameter)
    grads: torch.Tensor | None = None
    # seconds the last ``apply`` spent on the snapshot and on the optimizer step (profile)
    last_apply_s: tuple[float, float] = (0.0, 0.0)
    # the flat buffer ``acc`` views (``fresh_acc``); None when ``acc`` is anything else
    acc_flat: torch.Tensor | None = None
    # the two kept flat buffers ``fresh_acc`` alternates between
    _acc_bufs: list[torch.Tensor] = field(default_factory=list)
    # a snapshot taken ahead of ``apply`` (``prepare_snapshot``), and the version it holds
    # (-1: none); ``apply`` takes it instead of copying on the critical path
    _prepared: OptimizerSnapshot | None = None
    _prepared_version: int = -1
    # ``prepare_snapshot`` (the updater's thread) against ``apply`` (the step loop)
    _snap_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def params(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def fresh_acc(self, extra: int = 0) -> None:
        """Zeroed gradient accumulators for a step: views of one flat buffer, so the sync
        phase stashes them without a copy (``acc_flat`` becomes the stash) and a step zeroes
        one buffer instead of allocating a tensor per parameter.

        Two buffers alternate: never the one the stash is in, which a failover may still
        all-reduce and apply (the previous step's) while this step accumulates. ``extra``:
        elements past the gradients (the last block's loss travels with them).
        """
        params = self.params
        size = sum(p.numel() for p in params) + extra
        dtype = params[0].dtype if params else torch.float32
        device = params[0].device if params else torch.device("cpu")
        self._acc_bufs = [
            b
            for b in self._acc_bufs
            if b.numel() == size and b.dtype == dtype and b.device == device
        ]
        free = [b for b in self._acc_bufs if b is not self.stash]
        if free:
            buf = free[0]
            buf.zero_()
        else:
            buf = torch.zeros(size, dtype=dtype, device=device)
            self._acc_bufs.append(buf)
        views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            views.append(buf[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.acc = views
        self.acc_flat = buf

    def apply(self, reduced: torch.Tensor, step: int) -> None:
        """Step the optimizer with the all-reduced gradients of ``step`` (flat, in order).

        The snapshot taken first is what a failover rolls back to when this block ends up
        one step ahead of the step to resume.
        """
        if self.version != step:
            raise RuntimeFailure(
                f"block {self.index} is at version {self.version} but step {step} is being applied"
            )
        with self._snap_lock:
            self._apply(reduced, step)

    def prepare_snapshot(self) -> None:
        """Take the snapshot the next ``apply`` needs now, ahead of it (off the critical
        path: ``ReplicaUpdater.submit_task``, in a wait of the step). Between two updates
        the parameters and optimizer state do not change, so a snapshot of this version is
        the one ``apply`` would take; ``apply`` swaps it in, or copies as before when none
        of its version is ready. Safe beside the step's forwards and backwards, which only
        read the parameters."""
        with self._snap_lock:
            if self._prepared_version == self.version:
                return
            if self._prepared is None:
                self._prepared = OptimizerSnapshot()
            self._prepared.take(self.params, self.optimizer)
            self._prepared_version = self.version

    def drop_prepared(self) -> None:
        """Forget a prepared snapshot: the state was replaced outside ``apply`` (a rollback,
        a checkpoint load, a hand-over)."""
        with self._snap_lock:
            self._prepared_version = -1

    def _apply(self, reduced: torch.Tensor, step: int) -> None:
        t0 = time.monotonic()
        if self._prepared is not None and self._prepared_version == step:
            # taken ahead at this very version: the old snapshot's buffers are reused for
            # the next one
            self.snapshot, self._prepared = self._prepared, self.snapshot
        else:
            if self.snapshot is None:
                self.snapshot = OptimizerSnapshot()
            self.snapshot.take(self.params, self.optimizer)
        self._prepared_version = -1
        t1 = time.monotonic()
        params = self.params
        total = sum(p.numel() for p in params)
        # copied, not viewed: `reduced` is still being sent to the replica's holder, and an
        # optimizer may change its gradients in place
        if self.grads is None or self.grads.numel() != total or self.grads.dtype != reduced.dtype:
            self.grads = torch.empty(total, dtype=reduced.dtype, device=reduced.device)
        self.grads.copy_(reduced[:total])
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = self.grads[offset : offset + n].view_as(p)
            offset += n
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version = step + 1
        self.last_apply_s = (t1 - t0, time.monotonic() - t1)


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


class WorkerState:
    """The state of one worker that its step loop, interpreter and failover share."""

    def __init__(self, job: PipelineJob, opts: WorkerOptions) -> None:
        self.job = job
        self.opts = opts
        self.me = opts.worker
        self.P, self.D, self.M = opts.stages, opts.pipelines, job.microbatches
        self.pipe = self.me // self.P
        self.device = torch.device(opts.device)
        self.mode = job.redundancy
        self.timeout = timedelta(seconds=opts.detection_timeout_s)
        # all-reduce peers may legitimately wait for another pipeline's failover
        self.group_timeout = timedelta(seconds=max(4 * opts.detection_timeout_s, 20.0))
        self.lock = threading.RLock()
        # bumped by every failover: a thread that saw an older epoch was abandoned
        self.epoch = 0
        # set when the cluster state moved (a new generation, fatal, this worker evicted);
        # waits subscribe to it instead of polling it (comm.wait_any)
        self.changed = WakeableEvent()
        self.generation = 0
        self.topo = Topology(self.P, self.D, frozenset(), self.mode.has_replica)
        self.owned: dict[int, BlockState] = {}
        self.replica: BlockState | None = None
        self.frc: dict[tuple[int, int], FrcRecord] = {}
        self.progress = StepProgress(-1)
        # applies the replica's received updates on its own kept thread (settle_replica);
        # in a wait of the step where nothing else needs the replica soon: with eager FRC
        # the step's first FRC (in its first bubble) waits for the update, so it starts
        # at once and is done by then (measured: gated, the FRC lost that bubble to it)
        self.updater = ReplicaUpdater(
            lambda: self.epoch, self.log, when_idle=not self.mode.eager_frc
        )
        # seconds the worker's threads waited for the updater, by step (the profile)
        self.replica_settle_s: dict[int, float] = {}
        # seconds per step and phase of the step (``phase``; benchmarks' --profile)
        self.phases: dict[int, dict[str, float]] = {}
        self.batches: dict[tuple[int, int], Batch] = {}
        # shapes and dtype of block outputs, so a receiver can allocate before the message comes
        self.act_shapes: list[torch.Size] = []
        self.act_dtype = job.dtype
        self.step = 0
        self.events: list[str] = []
        self.transport: Transport | None = None
        self.groups: Groups | None = None

    def log(self, msg: str) -> None:
        self.events.append(msg)
        if self.opts.verbose:
            # one write, newline included (print writes it apart, and with an unbuffered
            # stderr the launcher's workers, which share its pipe, split each other's lines)
            sys.stderr.write(f"[worker {self.me}] {msg}\n")
            sys.stderr.flush()

    def guard(self, epoch: int) -> None:
        if epoch != self.epoch:
            raise Interrupted("abandoned by a failover")

    def check_kill(self, op: Op | str, microbatch: int = -1) -> None:
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

    def batch(self, step: int, microbatch: int) -> Batch:
        key = (step, microbatch)
        with self.lock:
            got = self.batches.get(key)
        if got is None:
            x, y = self.job.batch(step, self.pipe, microbatch)
            if x.is_floating_point():
                x = x.to(dtype=self.job.dtype)
            got = (x.to(self.device), y.to(self.device))
            with self.lock:
                self.batches[key] = got
        return got

    def phase(self, step: int, name: str, seconds: float) -> None:
        """Add ``seconds`` to phase ``name`` of ``step`` (where a step's time goes: forward,
        backward, receive waits, the sync phase's parts; ``Worker.phase_profile``)."""
        row = self.phases.get(step)
        if row is None:
            row = self.phases[step] = {}
        row[name] = row.get(name, 0.0) + seconds

    def settle_replica(self) -> float:
        """Wait until the replica's received updates are applied (``replica_update``).

        Called by whatever reads or replaces the replica: eager FRC before its forward, a
        failover's join before it reports versions or promotes the replica. Returns the
        seconds waited.
        """
        waited = self.updater.settle()
        if waited > 0:
            self.replica_settle_s[self.step] = self.replica_settle_s.get(self.step, 0.0) + waited
        return waited
