"""An elastic data-parallel worker on torch.distributed (docs/elastic.md).

Every step is one all-reduce of a single buffer: the gradients (each scaled by the
worker's sample count, so the sum over workers divided by the total count is the mean
over every sample of the step), then per-rank slots carrying each worker's report (its
positions in the epoch and its sample count: "each worker reports its offset every
mini-batch"), its compute time (straggler detection) and a re-form flag (the leader sets
it when a joiner is waiting, a leaver sets it for itself). No other collective runs while
the membership is unchanged.

A step whose all-reduce fails (a peer died, or another worker saw one die and wrote
`abort`) is not committed: no optimizer step, the data plan stays where it was, and its
samples are redone after the re-form (the log says so). The group is rebuilt per
generation from a new TCPStore (new port) hosted by the leader; the state (parameters,
optimizer, data plan, step) comes from the member with the most steps done, broadcast
only when someone needs it (a joiner, or a survivor behind after a partial failure).
Old process groups are kept, never destroyed: destroying one closes sockets that a peer
still blocked on it would read as a fresh failure. A wait walked away from stays blocked
in gloo until its peer goes; it runs on a non-daemon thread (`walkable_wait`) so that the
process still exits cleanly.
"""

from __future__ import annotations

import io
import json
import logging
import signal
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from contract import etcd_keys as keys
from contract.etcd import EtcdClient
from contract.registry import Registry
from learner.elastic.api import ElasticConfigError, ElasticError, ElasticJob, RemovedFromJob
from learner.elastic.data import DataPlan, Range, choose_source
from learner.elastic.rendezvous import EMPTY, Membership, Rendezvous

log = logging.getLogger(__name__)

GroupFactory = Callable[[dist.Store, int, int, timedelta], Any]
BACKENDS: Registry[GroupFactory] = Registry("process group backend", error=ElasticConfigError)
BACKENDS.register(
    "gloo", lambda store, rank, size, timeout: dist.ProcessGroupGloo(store, rank, size, timeout)
)


def _nccl(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)


BACKENDS.register("nccl", _nccl)

SLOT = 4  # per-rank slots: first position, sample count, compute seconds, re-form flag


def default_collate(items: Sequence[Any]) -> Any:
    """Stack tensors, and tuples of tensors field by field (`(x, y)` pairs)."""
    first = items[0]
    if isinstance(first, tuple):
        return tuple(default_collate([it[i] for it in items]) for i in range(len(first)))
    if isinstance(first, torch.Tensor):
        return torch.stack(list(items))
    return torch.tensor(list(items))


def walkable_wait(
    wait: Callable[[], object], name: str
) -> tuple[threading.Event, list[BaseException]]:
    """Run a blocking collective `wait` in a thread the caller may walk away from; the
    event is set when it returned or raised, the list then holds what it raised.

    The thread is *not* a daemon. gloo cannot cancel a wait (neither `abort()` nor
    `shutdown()` ends one, torch 2.13): an abandoned one ends only when its peer closes
    the connection or the group's timeout expires. A daemon thread that comes back from
    C++ while the interpreter finalizes is ended by force, through pybind's
    GIL-release guard, and the process aborts ("terminate called without an active
    exception", exit -6) — which happened when a survivor exited while the peer it had
    been waiting on exited too. A non-daemon thread is joined before finalization, so
    the process exits with its own code once the peer has gone (at worst after the
    group's timeout).
    """
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            wait()
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name=name, daemon=False).start()
    return done, errors


class ElasticWorker(ElasticJob):
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Sequence[Any],
        *,
        batch_size: int,
        job_id: str,
        etcd: str,
        worker: str | None = None,
        block_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        min_workers: int = 1,
        backend: str = "gloo",
        device: str = "cpu",
        host: str = "127.0.0.1",
        lease_ttl_s: int = 2,
        timeout_s: float = 60.0,
        collate: Callable[[Sequence[Any]], Any] = default_collate,
        sample_log: str | Path | None = None,
        straggler_window: int = 0,
        straggler_factor: float = 2.0,
        resume: dict[str, Any] | None = None,
    ) -> None:
        if batch_size <= 0:
            raise ElasticConfigError(f"batch_size must be a positive integer, got {batch_size}")
        if len(dataset) == 0:
            raise ElasticConfigError("the data set is empty: nothing to train on")
        if not job_id:
            raise ElasticConfigError("no job id: pass job_id= or set RHIZOME_JOB_ID")
        self.model = model
        self.optimizer = optimizer
        self.dataset = dataset
        self.collate = collate
        self.me = worker or uuid.uuid4().hex[:12]
        self.min_workers = min_workers
        self.backend = backend
        self.device = torch.device(device)
        self.timeout = timedelta(seconds=timeout_s)
        self.straggler_window = straggler_window
        self.straggler_factor = straggler_factor
        self._plan = DataPlan(len(dataset), batch_size, block_size or batch_size * 8, seed, shuffle)
        self._ids: tuple[int, list[int]] = (-1, [])
        self._step = 0
        self._membership = EMPTY
        self._group: Any = None
        self._graveyard: list[Any] = []
        # collective waits walked away from (walkable_wait), by generation
        self._abandoned: list[tuple[int, threading.Event]] = []
        self._pending: tuple[DataPlan, dict[str, Range | None]] | None = None
        self._leave_reason: str | None = None
        self._joins_held = False  # the leader holds joiners until the expected ones came
        self._left = False
        self._slow_streak = 0
        self._batch_started = 0.0
        # open for the worker's life (closed in close()): one line per committed step
        self._log = Path(sample_log).open("a") if sample_log else None  # noqa: SIM115
        self.client = EtcdClient.connect(etcd)
        self.rdzv = Rendezvous(self.client, job_id, self.me, lease_ttl_s=lease_ttl_s, host=host)
        self.stalls: list[dict[str, Any]] = []  # per re-form: kind, seconds (benchmarks read it)
        if resume is not None:  # a checkpoint: the most steps, so the handover spreads it
            self.load_state_dict(resume)
        self._join()

    # -- properties ---------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.me

    @property
    def step_count(self) -> int:
        return self._step

    @property
    def epoch(self) -> int:
        return self._plan.epoch

    @property
    def generation(self) -> int:
        return self._membership.generation

    @property
    def members(self) -> list[str]:
        return list(self._membership.members)

    @property
    def plan(self) -> DataPlan:
        return self._plan

    # -- joining ------------------------------------------------------------------------------
    def _join(self, attempts: int = 5) -> None:
        """Ask to join the current generation and wait to be admitted; a refusal for a
        stale generation (the job re-formed meanwhile) is retried with the new one."""
        started = time.monotonic()
        for _ in range(attempts):
            current, _ = self.rdzv.membership()
            self.rdzv.request_join(current.generation)
            try:
                self._await_generation(current.generation, joining=True)
            except ElasticError as exc:
                if "stale generation" in str(exc):
                    log.info("%s: %s; asking again", self.me, exc)
                    continue
                raise
            self.stalls.append({"kind": "join", "seconds": time.monotonic() - started})
            return
        raise ElasticError(
            f"{self.me}: refused {attempts} times as stale; is the job re-forming in a loop?"
        )

    def _await_generation(self, after: int, *, joining: bool) -> None:
        """Wait for a generation newer than `after` (leading the transition if this worker
        is or becomes leader), then build its group and take the state."""
        deadline = time.monotonic() + self.timeout.total_seconds() * 2
        while time.monotonic() < deadline:
            current, token = self.rdzv.membership()
            if current.generation > after:
                if self.me in current.members:
                    self._enter(current, joining=joining)
                    return
                if joining:
                    self.rdzv.check_refused(after)
                else:
                    raise RemovedFromJob(
                        f"{self.me} is not in generation {current.generation} (declared gone while away); "
                        "its state is stale, so it stops: start it again to rejoin"
                    )
            elif (not joining or not current.members) and self.rdzv.is_leader():
                # members lead; a joiner leads only the first formation (it has no state to hand over)
                self.rdzv.form_next(current, token, min_workers=self.min_workers)
                continue
            if joining:
                self.rdzv.check_refused(after)
            time.sleep(0.02)
        raise ElasticError(
            f"{self.me}: no generation after {after} formed within {2 * self.timeout.total_seconds():.0f} s"
        )

    def _enter(self, membership: Membership, *, joining: bool) -> None:
        host, port = membership.store.rsplit(":", 1)
        rank = membership.members.index(self.me)
        hosted = [s for s in self.rdzv.stores if s.port == int(port)]
        store = (
            hosted[0]
            if hosted
            else dist.TCPStore(host, int(port), None, False, timeout=self.timeout)
        )
        prefixed = dist.PrefixStore(f"gen{membership.generation}/", store)
        if self._group is not None:
            self._graveyard.append(self._group)
        self._group = BACKENDS.get(self.backend)(
            prefixed, rank, len(membership.members), self.timeout
        )
        self._membership = membership
        self._handover(joining)

    def _handover(self, joining: bool) -> None:
        """Everyone takes the state of the member with the most steps done."""
        members = self._membership.members
        rank = members.index(self.me)
        steps = torch.zeros(len(members), dtype=torch.float64)
        # a joiner without a checkpoint has nothing to offer: it never wins a tie at 0
        steps[rank] = -1 if joining and self._step == 0 else self._step
        self._group.allreduce([steps]).wait()
        by_worker = {w: int(steps[i]) for i, w in enumerate(members)}
        source = choose_source(by_worker)
        # broadcast when someone is behind or has no state yet (a joiner; at the first
        # generation every worker, so all start from the same initial parameters)
        if len(set(by_worker.values())) > 1 or -1 in by_worker.values():
            root = members.index(source)
            payload = self._pack() if self.me == source else b""
            size = torch.tensor([len(payload)], dtype=torch.int64)
            self._broadcast(size, root)
            buf = (
                torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                if payload
                else torch.zeros(int(size[0]), dtype=torch.uint8)
            )
            self._broadcast(buf, root)
            if self.me != source:
                self._unpack(buf.numpy().tobytes())
        self._plan = self._plan.reassign(list(members))
        log.debug("%s: plan after re-form: %s", self.me, self._plan.to_json())
        if self.rdzv.is_leader():
            self.client.put(
                keys.elastic_plan(self.rdzv.job), {"step": self._step, "plan": self._plan.to_json()}
            )
        log.info(
            "%s: generation %d, rank %d of %d, step %d (state from %s)",
            self.me,
            self._membership.generation,
            rank,
            len(members),
            self._step,
            source,
        )

    def _broadcast(self, tensor: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._group.broadcast([tensor], opts).wait()

    def _pack(self) -> bytes:
        buf = io.BytesIO()
        torch.save(self.state_dict(), buf)
        return buf.getvalue()

    def _unpack(self, data: bytes) -> None:
        self.load_state_dict(torch.load(io.BytesIO(data), weights_only=False))

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "plan": self._plan.to_json(),
            "step": self._step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._plan = DataPlan.from_json(state["plan"])
        self._step = int(state["step"])

    # -- training -----------------------------------------------------------------------------
    def batches(self, epochs: int) -> Iterator[Any]:
        while not self._left and self._plan.epoch < epochs:
            if self._plan.exhausted():
                self._plan = self._plan.next_epoch()
                continue
            new, got = self._plan.assign(list(self._membership.members))
            self._pending = (new, got)
            mine = got.get(self.me)
            self._batch_started = time.monotonic()
            if mine is None:  # nothing left for this worker this epoch: still in the all-reduce
                self._sync(None, 0)
                continue
            ids = self._sample_ids()
            yield self.collate([self.dataset[ids[p]] for p in range(*mine)])
            if self._pending is not None:
                raise ElasticError("call job.step(loss) once after each batch from job.batches()")

    def _sample_ids(self) -> list[int]:
        if self._ids[0] != self._plan.epoch:
            self._ids = (self._plan.epoch, self._plan.sample_ids())
        return self._ids[1]

    def step(self, loss: torch.Tensor) -> None:
        if self._pending is None:
            raise ElasticError(
                "job.step(loss) without a batch: iterate job.batches() and step once per batch"
            )
        mine = self._pending[1].get(self.me)
        count = 0 if mine is None else mine[1] - mine[0]
        # the loss is a mean over the batch: times the count it is the sum, so that the
        # all-reduced sum divided by the step's total count is the mean over all samples
        (loss * count).backward()
        self._sync(loss, count)

    def leave(self, reason: str = "requested") -> None:
        self._leave_reason = reason

    def _sync(self, loss: torch.Tensor | None, count: int) -> None:
        assert self._pending is not None
        new, got = self._pending
        self._pending = None
        members = self._membership.members
        rank = members.index(self.me)
        params = [p for p in self.model.parameters() if p.requires_grad]
        flat = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        slots = torch.zeros(
            len(members) * SLOT, dtype=flat[0].dtype if flat else torch.float32, device=self.device
        )
        mine = got.get(self.me)
        slots[rank * SLOT : rank * SLOT + 4] = torch.tensor(
            [
                mine[0] if mine else -1,
                count,
                time.monotonic() - self._batch_started,
                self._wants_reform(),
            ],
            dtype=slots.dtype,
        )
        buf = torch.cat([*flat, slots]) if flat else slots
        failure = self._allreduce(buf)
        if failure is not None:
            self.optimizer.zero_grad(set_to_none=True)
            redone = {w: list(r) for w, r in got.items() if r}
            log.warning(
                "%s: step %d did not complete (%s); its mini-batch samples %s are redone after the re-form",
                self.me,
                self._step,
                failure,
                redone,
            )
            self._record(
                {"redone": redone, "step": self._step, "epoch": self._plan.epoch, "reason": failure}
            )
            self._reform(failed=True)
            return
        reports = buf[-len(members) * SLOT :].reshape(len(members), SLOT)
        total = int(reports[:, 1].sum().item())
        for i, w in enumerate(members):
            expected = got.get(w)
            if int(reports[i, 1]) != (expected[1] - expected[0] if expected else 0):
                raise ElasticError(
                    f"worker {w} reported {int(reports[i, 1])} samples, the plan says {expected}: replicas diverged"
                )
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = (buf[offset : offset + n] / max(total, 1)).reshape(p.shape).clone()
            offset += n
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        ids = self._sample_ids()
        self._record(
            {
                "time": time.time(),
                "epoch": self._plan.epoch,
                "step": self._step,
                "generation": self._membership.generation,
                "samples": {w: [ids[q] for q in range(*r)] for w, r in got.items() if r},
            }
        )
        self._plan = new
        self._step += 1
        self._check_straggler(reports)
        if float(reports[:, 3].sum()) > 0:
            self._reform(failed=False)

    def _wants_reform(self) -> float:
        if self._leave_reason is not None:
            return 1.0
        if self.rdzv.joins_changed.is_set() or self._joins_held:
            self.rdzv.joins_changed.clear()
            joins = self.rdzv.pending_joins()
            self._joins_held = False
            if joins and self.rdzv.is_leader():
                if self.rdzv.joins_ready(joins):
                    self.rdzv.expectation_met()
                    return 1.0
                self._joins_held = True  # looked at again every step until ready
        return 0.0

    def _check_straggler(self, reports: torch.Tensor) -> None:
        """A worker slower than `straggler_factor` x the median compute time for
        `straggler_window` steps in a row leaves (every worker sees the same reports;
        the straggler acts on its own)."""
        if not self.straggler_window or len(self._membership.members) < 2:
            return
        times = [float(t) for t in reports[:, 2]]
        mine = times[self._membership.members.index(self.me)]
        median = statistics.median(times)
        self._slow_streak = self._slow_streak + 1 if mine > self.straggler_factor * median else 0
        if self._slow_streak >= self.straggler_window and self._leave_reason is None:
            self.leave(
                f"straggler: {self.straggler_window} mini-batches over {self.straggler_factor}x the median compute time"
            )
            log.warning("%s: %s", self.me, self._leave_reason)

    def _allreduce(self, buf: torch.Tensor) -> str | None:
        """Run the step's all-reduce; None when it completed, else why not. The wait
        runs in a thread this worker walks away from when another worker reports the
        generation broken (`abort`), so nobody sits out the group's whole timeout."""
        generation = self._membership.generation
        group = self._group
        done, errors = walkable_wait(
            lambda: group.allreduce([buf]).wait(), f"allreduce-g{generation}"
        )
        while not done.wait(0.05):
            if self.rdzv.abort_changed.is_set():
                self.rdzv.abort_changed.clear()
                if self.rdzv.aborted(generation):
                    self._abandoned.append((generation, done))
                    return f"generation {generation} aborted by a peer"
        if errors:
            self.rdzv.abort(generation)
            return f"{type(errors[0]).__name__}: {str(errors[0]).splitlines()[0] if str(errors[0]) else ''}"
        return None

    def _reform(self, *, failed: bool) -> None:
        started = time.monotonic()
        before = len(self._membership.members)
        if self._leave_reason is not None:
            self.rdzv.leave(self._leave_reason, self._step)
            self._left = True
            log.info("%s left at step %d (%s)", self.me, self._step, self._leave_reason)
            return
        self.rdzv.ack(self._membership.generation, self._step)
        self._await_generation(self._membership.generation, joining=False)
        after = len(self._membership.members)
        kind = "failure" if failed else ("scale-out" if after > before else "scale-in")
        self.stalls.append(
            {"kind": kind, "seconds": time.monotonic() - started, "step": self._step}
        )

    def _record(self, entry: dict[str, Any]) -> None:
        if self._log is not None:
            self._log.write(json.dumps({"worker": self.me, **entry}) + "\n")
            self._log.flush()

    def handle_sigterm(self) -> None:
        """SIGTERM (a spot notice, `rhizome scale` down) leaves at the next boundary."""

        def on_term(signum: int, frame: FrameType | None) -> None:
            self.leave("SIGTERM")

        signal.signal(signal.SIGTERM, on_term)

    def close(self) -> None:
        if not self._left:
            self.rdzv.leave("finished", self._step)
            self._left = True
        if self._log is not None:
            self._log.close()
            self._log = None
        self.client.close()
        pending = sorted({g for g, done in self._abandoned if not done.is_set()})
        if pending:
            log.info(
                "%s: the all-reduce of generation %s it walked away from is still blocked in gloo;"
                " the process exits when that peer has gone (at most %.0f s)",
                self.me,
                ", ".join(map(str, pending)),
                self.timeout.total_seconds(),
            )
