"""One pipeline worker: its lifecycle and the step loop (compute phase, sync phase, finish).

A worker starts (lease, partition, blocks, links), then runs steps: the compute phase
runs each owned block's instruction list through the ``Interpreter`` on a kept pool
thread (``comm.POOL``: no thread is started per step); then the sync phase: per owned block, in block order, the local
gradients are stashed (the accumulators' flat buffer), all-reduced across pipelines (on a
copy) and sent to the block's replica holder (the send is awaited by the next sync
phase), then a snapshot of parameters and optimizer state is taken and the optimizer
steps; the holder applies the same update, so replica and original stay
bit-identical. The holder's step ends once that update is received; applying it runs on
the worker's kept updater thread (``replica_update``), off the step loop, while the next
step's forwards and waits go on. A watcher thread keeps the etcd lease and acts on the cluster state's
changes, which an etcd watch delivers (``cluster_watch``; nothing polls etcd in steady
training). An
interrupted step (a link error, a new generation) goes to ``Failover``, which returns
the step to resume and what is left of it.

The pieces: ``worker_state`` (what the worker holds, shared), ``interpreter`` (a block's
program), ``failover`` (declaring dead, joining the next generation), ``recovery`` (what
is left of an interrupted step).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from learner.checkpoint.notices import NoticeBoard
from learner.runtime import block_checkpoint, reconfigure
from learner.runtime import schedule as sched
from learner.runtime.api import (
    ConfigError,
    FatalFailure,
    Interrupted,
    LinkError,
    PipelineJob,
    RuntimeFailure,
)
from learner.runtime.bubbles import PLACES
from learner.runtime.cluster_state import ClusterStateStore, initial_state
from learner.runtime.cluster_watch import ClusterView
from learner.runtime.comm import (
    SYNC,
    BackgroundCall,
    Groups,
    Transport,
    first_sentence,
    interruptible,
    tag,
    wait_any,
)
from learner.runtime.failover import Failover
from learner.runtime.halt import Halt
from learner.runtime.interpreter import Interpreter
from learner.runtime.options import LINK_KILL_POINT, KillPoint, WorkerOptions
from learner.runtime.partition import balanced_boundaries, param_costs, profile_costs
from learner.runtime.schedule import Instr, Op
from learner.runtime.step_metrics import StepMetricsFile
from learner.runtime.topology import Topology
from learner.runtime.worker_state import BlockState, StepProgress, WorkerState, prefer_foreach

# worker.py and launch.py import the options together with Worker from here
__all__ = ["KillPoint", "Worker", "WorkerOptions"]

# torch.manual_seed is process-global; in-process runs build several workers at once.
_SEED_LOCK = threading.Lock()

# Lease refreshes per TTL: every TTL/3, as etcd's own Go client (clientv3) refreshes. In
# steady training they are all the runtime sends etcd, and etcd's CPU grows with their
# rate (benchmarks/RESULTS.md, session 10: +1.05 / +0.46 / +0.14 % of a core at 8 / 4 /
# 2 refreshes a second); a third fewer than at TTL/4 still leaves two thirds of the TTL
# for a late refresh. Failure detection does not depend on it: a lease lapses TTL after
# its worker's last refresh either way.
KEEPALIVES_PER_TTL = 3


class Worker:
    """A pipeline stage process (or thread, in-process) of one job."""

    def __init__(
        self,
        job: PipelineJob,
        opts: WorkerOptions,
        cluster: ClusterStateStore,
        store: dist.Store,
        notices: NoticeBoard | None = None,
        save_prior_s: float = 10.0,
    ) -> None:
        """``notices``: the checkpoint layer's notice sources, started (worker.py); on a
        notice the worker saves with the others or leaves (halt.py). ``save_prior_s``: a
        block save's duration until one is measured (``RHIZOME_SAVE_S``)."""
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
        self.state = WorkerState(job, opts)
        self.interpreter = Interpreter(self.state)
        self.failover = Failover(self.state, cluster, store)
        self.halt = (
            None
            if notices is None
            else Halt(
                self.state,
                cluster,
                notices,
                checkpoint_dir=opts.checkpoint_dir,
                save_prior_s=save_prior_s,
                declare_dead=self.failover.declare_dead,
            )
        )
        self._last_periodic: int | None = None
        self._stopped = threading.Event()
        self._members_complete = threading.Event()
        self._view = ClusterView()
        self._cancel_watch: Callable[[], None] | None = None
        self.loss_history: list[tuple[int, float]] = []
        # (step, seconds since the previous step ended): failover pauses land in here
        self.step_times: list[tuple[int, float]] = []
        # time.monotonic() and time.process_time() at the end of each step, in step_times'
        # order: benchmarks take the steady-state wall and CPU time of a window of steps
        self.step_ends: list[float] = []
        self.step_cpu: list[float] = []
        self._t_last = time.monotonic()
        # seconds per step the sync phase spent waiting for the replica's update and
        # applying one on its own thread (benchmarks/runtime_vs_torch.py --profile)
        self.sync_profile: dict[int, dict[str, float]] = {}
        # each ended step's time, loss and FRC places, shipped by the platform's collector
        self.step_metrics = StepMetricsFile(opts.metrics_file, self.state.log, opts.metrics_every)
        # flat gradients (+ the loss on the last stage) per owned block, reused every step
        self._stash_bufs: dict[int, torch.Tensor] = {}
        # the receive of the replica's update, posted when its step starts:
        # (step, transport, replica, the call)
        self._update_recv: tuple[int, Transport, BlockState, BackgroundCall[Any]] | None = None
        # this worker's own update sends of the last step, waited for by the next sync
        # phase (or the finish): (holder, work, the tensor sent, transport)
        self._update_sends: list[tuple[int, Any, torch.Tensor, Transport]] = []
        # take each owned block's pre-update snapshot in the step's first wait (on the
        # updater's thread) rather than in the sync phase, where it sat between the step's
        # last backward and the next step's first forward; not with eager FRC, whose
        # first wait is full of FRC: there the snapshot pushed FRC out and delayed the
        # first one, which waits for it (1.10-1.11x slower in both runs of
        # benchmarks/RESULTS.md, session 13). False: never (the before of that pair)
        self.snapshot_ahead = True

    # what callers inspect after a run (benchmarks/runtime_overhead.py reads me and owned)
    @property
    def me(self) -> int:
        return self.state.me

    @property
    def owned(self) -> dict[int, BlockState]:
        return self.state.owned

    @property
    def generation(self) -> int:
        return self.state.generation

    @property
    def events(self) -> list[str]:
        return self.state.events

    # ------------------------------------------------------------------ setup

    def _build(self) -> None:
        st = self.state
        with _SEED_LOCK:
            torch.manual_seed(self.job.seed)
            layers = [layer.to(dtype=self.job.dtype) for layer in self.job.build_layers()]
        self.boundaries = self._partition(layers)
        self.layer_count = len(layers)
        blocks = [
            nn.Sequential(*layers[a:b]).to(st.device)
            for a, b in zip(self.boundaries, self.boundaries[1:], strict=False)
        ]
        # shapes of block outputs, so a receiver can allocate before the message comes
        x, _ = st.batch(0, 0)
        st.act_shapes = []
        with torch.no_grad():
            for block in blocks:
                x = block(x)
                st.act_shapes.append(x.shape)
        st.act_dtype = self.job.dtype
        my_block = st.me % st.P
        st.owned = {my_block: self._block_state(my_block, blocks[my_block])}
        rep = st.topo.replica_block(st.me)
        if rep is not None:
            st.replica = self._block_state(rep, blocks[rep])

    def _block_state(self, index: int, module: nn.Module) -> BlockState:
        return BlockState(index, module, prefer_foreach(self.job.optimizer(module.parameters())))

    def _partition(self, layers: list[nn.Module]) -> list[int]:
        P = self.state.P
        if self.job.balance == "params":
            return balanced_boundaries(param_costs(layers), P)
        # profiled times differ between processes: one worker decides for everybody
        if self.state.me == 0 and self.opts.join_token is None:  # a joiner reads it
            x, _ = self.job.batch(0, 0, 0)
            costs = profile_costs(layers, x.to(dtype=self.job.dtype))
            bounds = balanced_boundaries(costs, P)
            self.cluster.put("partition", {"boundaries": bounds})
            return bounds
        deadline = time.monotonic() + self.opts.startup_timeout_s
        while time.monotonic() < deadline:
            got = self.cluster.get("partition")
            if got is not None:
                return [int(b) for b in got["boundaries"]]
            time.sleep(self.opts.poll_s)
        raise RuntimeFailure("worker 0 never published the partition")

    def _start(self) -> int:
        """Register, build, link; returns the step to start at (0, or a joiner's)."""
        st = self.state
        # The first optimizer of a process imports torch._dynamo: seconds of CPU, much of
        # it in C without a GIL switch, during which a loaded machine let the lease lapse
        # (peers declared the worker dead at start-up). Paid before the lease exists.
        self.job.optimizer([nn.Parameter(torch.zeros(1))])
        self.cluster.register(st.me, self.opts.lease_ttl_s)
        # keep the lease from the first moment: the first torch calls of a fresh process
        # can take longer than a short lease
        self._watcher = threading.Thread(target=self._watch, name="watcher", daemon=True)
        self._watcher.start()
        # not from the watcher thread: creating the watch can take a while on a busy
        # machine, and the lease must be refreshed meanwhile
        self._cancel_watch = self.cluster.watch(self._view.apply)
        state = initial_state(self.cluster, st.P, st.D, joining=self.opts.join_token is not None)
        if self.opts.join_token is not None:
            return self._join_running()
        if state.generation != 0:
            raise ConfigError(
                f"job already at generation {state.generation}: a worker joins a running job "
                "only as a replacement with a ticket (RHIZOME_RUNTIME_JOIN_TOKEN, "
                "learner/runtime/reconfigure.py); else use a fresh job id"
            )
        # past the check above: a growth (reconfigure.plan_growth) may come now without
        # this worker refusing a job "already at generation 1"
        self.cluster.put(f"started/{st.me}", {"generation": 0})
        deadline = time.monotonic() + self.opts.startup_timeout_s
        while len(self.cluster.alive_members()) < st.P * st.D:
            if time.monotonic() > deadline:
                raise RuntimeFailure(
                    f"only {len(self.cluster.alive_members())} of {st.P * st.D} workers "
                    f"registered within {self.opts.startup_timeout_s:.0f} s"
                )
            time.sleep(self.opts.poll_s)
        self._members_complete.set()
        self._view.changed.set()  # the watcher may now look for missing members
        t0 = time.monotonic()
        self._build()
        first_step = self._restore_checkpoint()
        t1 = time.monotonic()
        st.transport = Transport(
            st.me, 0, self.opts.backend, self.store, st.timeout, st.device, self.opts.address
        )
        st.check_kill(LINK_KILL_POINT)
        st.transport.connect(st.topo.peers(st.me), st.changed)
        st.groups = Groups(
            st.me, 0, self.opts.backend, self.store, st.group_timeout, self.opts.address
        )
        self._t_last = time.monotonic()
        st.log(
            f"started: stage {st.me % st.P} of pipeline {st.pipe}, layers {self.boundaries}, "
            f"built in {t1 - t0:.2f} s, "
            f"links in {time.monotonic() - t1:.2f} s"
        )
        return first_step

    def _restore_checkpoint(self) -> int:
        """A job restarted after a fatal loss starts from its latest complete block
        checkpoint (block_checkpoint.py); returns the step to start at (0 without one)."""
        st = self.state
        step = block_checkpoint.latest_complete(self.opts.checkpoint_dir, st.P)
        if step is None or self.opts.checkpoint_dir is None:
            return 0
        self._last_periodic = step
        for blk in [*st.owned.values(), *([st.replica] if st.replica else [])]:
            block_checkpoint.load(self.opts.checkpoint_dir, blk, step)
        st.log(
            f"restored blocks {sorted(st.owned)} and the replica from the checkpoint of step {step}"
        )
        return step

    def _save_checkpoint(self, step: int) -> None:
        """At the boundary before ``step``, every ``checkpoint_every`` steps."""
        every, directory = self.opts.checkpoint_every, self.opts.checkpoint_dir
        if directory and every > 0 and step % every == 0 and step < self.job.steps:
            t0 = time.monotonic()
            block_checkpoint.save(directory, list(self.state.owned.values()), step)
            self._last_periodic = step
            if self.halt is not None:
                # what an emergency save at a halt will take (halt.py's fit check)
                self.halt.save_s = time.monotonic() - t0

    def _join_running(self) -> int:
        """A replacement admitted into a lost slot (reconfigure.py): build the model from
        the seed like everyone, then join the running generation, where the keepers hand
        over this slot's blocks; returns the step to start, from its start."""
        st = self.state
        self._members_complete.set()
        self._build()
        st.generation = -1
        st.changed.set()
        step, rest = self.failover.recover()
        if rest is not None:
            raise RuntimeFailure("a joiner's first generation must restart the step")
        self._t_last = time.monotonic()
        return step

    # ---------------------------------------------------------------- watcher

    def _watch(self) -> None:
        """Keep the lease; flag a new generation; declare dead a peer whose lease expired.

        Event-driven (``cluster_watch``): it wakes on a change under the job's prefix and,
        every third of the lease TTL (``KEEPALIVES_PER_TTL``), to refresh this worker's lease;
        nothing else.
        """
        st = self.state
        view = self._view
        next_keepalive = 0.0
        while not self._stopped.is_set():
            now = time.monotonic()
            if now >= next_keepalive:
                try:
                    self.cluster.keepalive()
                except Exception as exc:  # etcd away for a moment: the lease outlives it
                    st.log(f"watcher: lease refresh: {exc!r}")
                next_keepalive = now + self.opts.lease_ttl_s / KEEPALIVES_PER_TTL
                if self.halt is not None:
                    try:
                        # put at once: the peers' agreement must not wait for this
                        # worker's step to end (halt.py)
                        self.halt.post()
                    except Exception as exc:
                        st.log(f"watcher: posting a notice: {exc!r}")
            if view.changed.wait(max(0.0, next_keepalive - time.monotonic())):
                view.changed.clear()
                try:
                    self._on_cluster_change()
                except Exception as exc:  # a flaky etcd write must not kill the watcher
                    st.log(f"watcher: {exc!r}")
                    view.changed.set()  # look again
                    self._stopped.wait(self.opts.poll_s)

    def _on_cluster_change(self) -> None:
        st = self.state
        seen = self._view.snapshot()
        state = seen.state
        if state is None or not self._members_complete.is_set():
            return
        if self.halt is not None and self.halt.halting:
            # a halt's save was agreed: peers that leave now are not failures
            if state.generation > st.generation or state.fatal or st.me in state.dead:
                st.changed.set()
            return
        # only a newer generation: the view can lag behind a transition this worker made
        if state.generation > st.generation or state.fatal or st.me in state.dead:
            st.changed.set()
        # a worker that finished the job lets its lease go: not a failure
        done = seen.done.get(state.generation, frozenset())
        # the state's D: after a growth the new pipeline's slots are watched too (once
        # seen registered)
        for w in Topology(st.P, state.pipelines, frozenset(state.dead)).alive:
            if w != st.me and w in seen.seen and w not in seen.members and w not in done:
                self.failover.declare_dead(w, "etcd lease expired")
        for w in reconfigure.lost_growth_joiners(state, seen.members, seen.standbys):
            if w != st.me and w not in done:
                self.failover.declare_dead(
                    w, "a standby admitted by a growth left before it joined"
                )

    # ------------------------------------------------------------- main loop

    def run(self) -> dict[str, torch.Tensor]:
        """Train ``job.steps`` steps; returns the parameters of the blocks this worker owns."""
        st = self.state
        try:
            # None: a fresh step; else what a failover left of the step, per owned block
            rest: dict[int, list[Instr]] | None = None
            try:
                step = self._start()
            except (Interrupted, LinkError) as exc:
                # a worker lost after every worker registered, while generation 0's links
                # formed: the same failover as a loss within a step (the blocks are the
                # seed's, so the shadow's replica is already current)
                step, rest = self._fail_over(f"forming generation 0: {exc}", exc)
            while True:
                st.step = step
                try:
                    if step >= self.job.steps:
                        self._finish()
                        return self.params()
                    if rest is None and self.halt is not None:
                        self.halt.step_s = max((t for _, t in self.step_times[-16:]), default=0.0)
                        self.halt.at_boundary(step, self._last_periodic)
                    t0 = time.monotonic()
                    self._compute(step, rest)
                    t1 = time.monotonic()
                    st.phase(step, "compute_phase", t1 - t0)
                    self._sync(step)
                    st.phase(step, "sync_phase", time.monotonic() - t1)
                    step += 1
                    rest = None
                    self._save_checkpoint(step)
                except (Interrupted, LinkError) as exc:
                    step, rest = self._fail_over(f"step {step}: {exc}", exc)
        except FatalFailure as exc:
            if self.job.on_fatal is not None:
                self.job.on_fatal(exc)
            raise
        finally:
            self.step_metrics.close()
            st.updater.close()
            self._stopped.set()
            self._view.changed.set()  # wake the watcher to stop its watch
            if self._cancel_watch is not None:
                # before the caller closes the store's client
                self._cancel_watch()
            if st.transport is not None:
                st.transport.close()

    def _fail_over(
        self, what: str, exc: Interrupted | LinkError
    ) -> tuple[int, dict[int, list[Instr]] | None]:
        """Join the generation a loss made; returns the step to resume and what is left of
        it (failover.py `recover`)."""
        self.state.log(what)
        if isinstance(exc, LinkError):
            self.failover.on_link_error(exc)
        return self.failover.recover()

    def params(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for b, blk in self.state.owned.items():
            start = self.boundaries[b]
            for name, tensor in blk.module.state_dict().items():
                local, _, rest = name.partition(".")
                out[f"{start + int(local)}.{rest}"] = tensor.detach().cpu().clone()
        return out

    # ----------------------------------------------------------- compute phase

    def _compute(self, step: int, rest: dict[int, list[Instr]] | None) -> None:
        """Run the step's pipeline part: the full schedule, or ``rest`` after a failover."""
        st = self.state
        recovering = rest is not None
        t_setup = time.monotonic()
        with st.lock:
            epoch = st.epoch
            if rest is None:
                st.batches = {k: v for k, v in st.batches.items() if k[0] >= step}
                st.frc = {k: r for k, r in st.frc.items() if r.step == step}
                st.progress = StepProgress(step, {b: set() for b in st.owned})
                for b, blk in st.owned.items():
                    # the last block's loss travels in one more element with its gradients
                    blk.fresh_acc(1 if b == st.P - 1 else 0)
                rest = {b: self._program(b) for b in st.owned}
        # what freeing the last step's records (its FRC graphs, outputs) and zeroing the
        # accumulators cost, before this step's first forward
        st.phase(step, "step_setup", time.monotonic() - t_setup)
        if not recovering and st.replica is not None:
            # posted now, not in the sync phase: gloo moves a message once both sides have
            # posted, so the update then travels while this worker still computes
            self._replica_update_recv(step)
        if not recovering and self.snapshot_ahead and not st.mode.eager_frc:
            # nothing changes a block between its updates: its snapshot for this step's
            # update can be taken in the step's first wait (a bubble) instead of in the
            # sync phase; apply() copies as before if it was not
            for blk in st.owned.values():
                st.updater.submit_task(blk.prepare_snapshot, epoch)
        programs = {b: prog for b, prog in rest.items() if prog}
        # each block's program on a kept pool thread (comm.POOL), not a thread per step
        calls = [
            BackgroundCall(
                lambda b=b: self.interpreter.run_block(  # type: ignore[misc]
                    b, step, epoch, programs[b], recovering
                ),
                f"block{b}",
            )
            for b in sorted(programs)
        ]
        pending = list(calls)
        while pending:
            wait_any(pending, st.changed)  # wakes on a block's end or a new generation
            for call in [c for c in pending if c.done.is_set()]:
                pending.remove(call)
                call.result()  # a block's error ends the step at once
            if pending and st.changed.is_set():
                raise Interrupted(f"generation changed during step {step}")

    def _program(self, b: int) -> list[Instr]:
        st = self.state
        rep = st.replica.index if (st.replica is not None and b == (st.me % st.P)) else None
        return sched.pipeline_part(
            sched.build(
                b,
                st.P,
                st.M,
                self.job.schedule,
                replica=rep,
                eager_brc=st.mode.eager_brc,
            )
        )

    # -------------------------------------------------------------- sync phase

    def _step_loss(self, step: int) -> float:
        prog = self.state.progress
        if prog.step != step:
            return 0.0
        return sum(prog.losses[m] for m in sorted(prog.losses))

    def _sync(self, step: int) -> None:
        st = self.state
        tr, groups = st.transport, st.groups
        assert tr is not None and groups is not None
        t_sends = time.monotonic()
        self._wait_update_sends()
        st.phase(step, "update_send_wait", time.monotonic() - t_sends)
        loss: float | None = None
        for b in sorted(st.owned):
            blk = st.owned[b]
            t0 = time.monotonic()
            extra = 1 if b == st.P - 1 else 0
            flat = blk.acc_flat
            if blk.stash_step != step and flat is not None and flat.numel() == blk.numel() + extra:
                # the accumulators are views of this buffer (fresh_acc): it is the stash
                if extra:
                    flat[-1] = self._step_loss(step)
                blk.stash = flat
                blk.stash_step = step
            elif blk.stash_step != step:
                parts = [a.reshape(-1) for a in blk.acc]
                if b == st.P - 1:
                    parts.append(
                        torch.tensor(
                            [self._step_loss(step)], dtype=self.job.dtype, device=st.device
                        )
                    )
                # into a buffer kept per block, not a new one each step; the previous
                # step's stash is no longer needed once this step's is written
                numel = sum(t.numel() for t in parts)
                buf = self._stash_bufs.get(b)
                if buf is None or buf.numel() != numel:
                    buf = self._stash_bufs[b] = torch.empty(
                        numel, dtype=self.job.dtype, device=st.device
                    )
                if parts:
                    torch.cat(parts, out=buf)
                blk.stash = buf
                blk.stash_step = step
            st.check_kill(Op.ALLREDUCE)
            assert blk.stash is not None
            t1 = time.monotonic()
            reduced = groups.allreduce(b, st.topo.group(b), blk.stash, st.changed)
            t2 = time.monotonic()
            st.check_kill(Op.OPTIMIZER)
            n = blk.numel()
            holder = st.topo.replica_holder(st.pipe, b)
            if holder is not None:
                # sent before this worker's own optimizer step, which does not change
                # `reduced` (apply copies it): the holder's copy travels meanwhile
                sent = reduced[:n]
                work = tr.send(holder, tag(SYNC, b, step, 0), sent)
                if work is not None:
                    self._update_sends.append((holder, work, sent, tr))
            blk.apply(reduced, step)
            if b == st.P - 1:
                loss = float(reduced[n].item())
            st.phase(step, "stash", t1 - t0)
            st.phase(step, "allreduce", t2 - t1)
            st.phase(step, "snapshot", blk.last_apply_s[0])
            st.phase(step, "optimizer", blk.last_apply_s[1])
        if st.replica is not None:
            rep = st.replica
            # posted when the step started (or now, after a failover): the FRC left over
            # runs while the update is on its way (on the last stage that is its cool-down
            # bubble: the update comes after its predecessors' last backwards)
            update = self._replica_update_recv(step)
            if st.mode.eager_frc:
                # before the replica's update is applied: FRC belongs to this step's version
                t_frc = time.monotonic()
                self.interpreter.leftover_frc(step, update)
                st.phase(step, "leftover_frc", time.monotonic() - t_frc)
            t_wait = time.monotonic()
            with st.updater.idle():
                wait_any([update], st.changed)
            if not update.done.is_set():
                raise Interrupted(
                    f"configuration changed while waiting for replica update of block {rep.index}"
                )
            # applied on the updater's kept thread from now on, while this thread finishes
            # the step and starts the next (its forwards, its waits: the bubbles); the
            # step still ends only once the update is here (what a failover relies on)
            st.updater.submit(rep, update.result(), step, st.epoch)
            self.sync_profile[step] = {
                "replica_wait": time.monotonic() - t_wait,
                # the previous update, on the updater's thread
                "replica_apply_bg": st.updater.applied_s.pop(step - 1, 0.0),
                # how long this step's threads waited for it (eager FRC before its forward)
                "replica_settle": st.replica_settle_s.pop(step, 0.0),
            }
            st.phase(step, "replica_wait", self.sync_profile[step]["replica_wait"])
        now = time.monotonic()
        self.step_times.append((step, now - self._t_last))
        self.step_ends.append(now)
        self.step_cpu.append(time.process_time())
        self._t_last = now
        frc = self.interpreter.frc_profile.per_step.get(step)
        self.step_metrics.write(
            step,
            iter_s=self.step_times[-1][1],
            generation=st.generation,
            loss=loss,
            frc_s=(frc or dict.fromkeys(PLACES, 0.0)) if self.job.redundancy.eager_frc else None,
        )
        if loss is not None:
            self.loss_history.append((step, loss))
            if st.pipe == 0 or all(
                st.topo.owner(d, st.P - 1) in st.topo.dead for d in range(st.pipe)
            ):
                print(
                    f"step {step} loss {loss:.6f} generation {st.generation} "
                    f"time {self.step_times[-1][1]:.4f}",
                    flush=True,
                )

    def _replica_update_recv(self, step: int) -> BackgroundCall[Any]:
        """The receive of the replica's update of ``step`` on a pool thread: the one posted
        when the step started, or a new one when the configuration (the transport or the
        replica) changed since (a failover; the old receive is abandoned with its links)."""
        st = self.state
        rep, tr = st.replica, st.transport
        assert rep is not None and tr is not None
        got = self._update_recv
        if got is not None and got[0] == step and got[1] is tr and got[2] is rep:
            return got[3]
        src = st.topo.owner(st.pipe, rep.index)
        shape = torch.Size([rep.numel()])
        call: BackgroundCall[Any] = BackgroundCall(
            lambda: tr.recv(src, tag(SYNC, rep.index, step, 0), shape, self.job.dtype),
            f"wait-replica-update-{rep.index}",
        )
        self._update_recv = (step, tr, rep, call)
        return call

    def _wait_update_sends(self) -> None:
        """Wait for this worker's update sends of the last step (left in flight when it
        ended, so the next step's forwards start at once). The tensor sent stays referenced
        until then; the stash it views is not reused before (``fresh_acc`` alternates two
        buffers). Sends on an earlier generation's links are abandoned with them."""
        st = self.state
        pending, self._update_sends = self._update_sends, []
        for holder, work, _sent, tr in pending:
            if tr is not st.transport:
                continue
            try:
                interruptible(work.wait, st.changed, "replica update send")
            except RuntimeError as exc:
                # gloo's "Connection closed by peer" when the holder died mid-send: a lost
                # peer (failover), like every other send and receive, not a crash
                raise LinkError(holder, first_sentence(exc)) from exc

    # ------------------------------------------------------------------ finish

    def _finish(self) -> None:
        st = self.state
        if self.opts.out_dir:
            out = Path(self.opts.out_dir)
            out.mkdir(parents=True, exist_ok=True)
            torch.save(self.params(), out / f"worker{st.me}.pt")
        # the last step's update sends end before this worker says it is done
        self._wait_update_sends()
        # Leave together: a worker that exits while a peer still reads from it would
        # look like a failure to that peer.
        # A failure in the last step sends everybody back (Interrupted) to redo it.
        self.cluster.put(f"done/{st.generation}/{st.me}", {"step": self.job.steps})
        deadline = time.monotonic() + 4 * self.opts.detection_timeout_s + 30
        while time.monotonic() < deadline:
            if st.changed.is_set():
                self.failover.read_state()
                raise Interrupted("generation changed while finishing")
            done = {
                int(k.rsplit("/", 1)[1]) for k in self.cluster.get_prefix(f"done/{st.generation}/")
            }
            if all(w in done for w in st.topo.alive):
                st.log(
                    f"finished: {self.job.steps} steps, blocks {sorted(st.owned)} of pipeline "
                    f"{st.pipe}, generation {st.generation}"
                )
                # where the redundant forward ran (issue #24): the claim, in every run's log
                frc = self.interpreter.frc_profile.summary()
                if frc is not None:
                    st.log(frc)
                return
            time.sleep(self.opts.poll_s)
        st.log("some workers did not finish; leaving anyway")
