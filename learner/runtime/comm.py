"""Point-to-point links and all-reduce groups, rebuilt per configuration generation.

Every link (a pair of workers) and every all-reduce group (the owners of one block) is
its own process group, built directly — not the default group — from
``PrefixStore(f"gen{g}/...", store)``. Consequences, all on purpose:

- A dead worker breaks only the groups it is in; survivors keep their processes,
  parameters and optimizer state, and build generation ``g+1`` groups in milliseconds.
- Old groups are never destroyed (``_graveyard``): destroying one closes its sockets,
  which a peer still blocked on it would read as "Connection closed by peer", i.e. a
  false failure.
- gloo closes a pair when a ``wait(timeout)`` expires ("Application timeout caused pair
  closure", seen on torch 2.13) and ``is_completed()`` never reports a dead peer, so we
  never poll with short timeouts: a blocking wait runs in a thread the caller can walk
  away from (``interruptible``), with the group's own timeout as the last resort.

Backends are registered by name (``gloo`` on CPU, ``nccl`` on GPU) like
torch.distributed.elastic's rendezvous handlers.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from contract.registry import Registry
from learner.runtime.api import ConfigError, Interrupted, LinkError

# (store, rank, size, timeout, address): `address` is this worker's own, where the
# group's connections are accepted (never every interface: see docs/security.md).
GroupFactory = Callable[[dist.Store, int, int, timedelta, str], Any]
BACKENDS: Registry[GroupFactory] = Registry("process group backend", error=ConfigError)


def register_backend(name: str, factory: GroupFactory | str) -> None:
    BACKENDS.register(name, factory)


def _gloo(store: dist.Store, rank: int, size: int, timeout: timedelta, address: str) -> Any:
    # gloo's default device listens on whatever the host name resolves to; the
    # worker's own address keeps its links off the other interfaces.
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _nccl(store: dist.Store, rank: int, size: int, timeout: timedelta, address: str) -> Any:
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)


register_backend("gloo", _gloo)
register_backend("nccl", _nccl)


def make_group(
    backend: str,
    store: dist.Store,
    rank: int,
    size: int,
    timeout: timedelta,
    address: str = "127.0.0.1",
) -> Any:
    return BACKENDS.get(backend)(store, rank, size, timeout, address)


def route_address(host: str) -> str:
    """This machine's own address on the route to `host` (the rendezvous store or etcd):
    the address peers that reach `host` can reach this worker by. A connected UDP socket
    sends nothing; connecting only picks the route."""
    family, _, _, _, target = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        return str(probe.getsockname()[0])


T = TypeVar("T")


class WakeableEvent(threading.Event):
    """A ``threading.Event`` that also calls its subscribers when set.

    What lets a wait end on "the call returned, or the configuration changed" without a
    timed poll: the waiter subscribes its wake-up to the event (``interruptible``).
    """

    def __init__(self) -> None:
        super().__init__()
        self._subscribers: list[Callable[[], None]] = []
        self._sub_lock = threading.Lock()

    def set(self) -> None:
        super().set()
        with self._sub_lock:
            subscribers = list(self._subscribers)
        for wake in subscribers:
            wake()

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call ``wake()`` whenever the event is set; returns the unsubscribe function."""
        with self._sub_lock:
            self._subscribers.append(wake)

        def unsubscribe() -> None:
            with self._sub_lock:
                if wake in self._subscribers:
                    self._subscribers.remove(wake)

        return unsubscribe


class _Pool:
    """Long-lived daemon threads that run the runtime's blocking calls.

    A step used to start a thread per block, per filled receive and per sync-phase wait;
    these run here instead, on threads that are kept. A thread is added only when all are
    busy — which in steady state never happens after the first steps, and after a
    failover happens once per call abandoned on a dead configuration (it stays blocked
    in gloo, see the module docstring).
    """

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self.started = 0  # threads started so far (tests: constant over steps)

    def submit(self, task: Callable[[], None]) -> None:
        with self._lock:
            self._tasks.put(task)
            if self._idle > 0:
                self._idle -= 1  # that idle thread takes it
                return
            self.started += 1
            n = self.started
        threading.Thread(target=self._serve, name=f"runtime-pool-{n}", daemon=True).start()

    def idle(self) -> None:
        """Called by a task as its last act, before it signals completion: a caller woken
        by that signal then finds this thread free instead of starting another."""
        with self._lock:
            self._idle += 1

    def _serve(self) -> None:
        while True:
            self._tasks.get()()


POOL = _Pool()


class BackgroundCall(Generic[T]):
    """``fn()`` running on a pool thread; ``done`` is set when it returned or raised."""

    def __init__(
        self, fn: Callable[[], T], name: str, on_done: Callable[[], None] | None = None
    ) -> None:
        self.name = name
        self.done = threading.Event()
        self.finished_at = 0.0  # time.monotonic() when fn returned or raised
        self._value: T | None = None
        self._error: BaseException | None = None
        self._on_done = on_done
        POOL.submit(lambda: self._run(fn))

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self._value = fn()
        except BaseException as exc:
            self._error = exc
        finally:
            self.finished_at = time.monotonic()
            POOL.idle()
            self.done.set()
            if self._on_done is not None:
                self._on_done()

    def result(self) -> T:
        """Wait for ``fn`` and return its value (or raise its error)."""
        self.done.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def wait_any(calls: list[BackgroundCall[Any]], stop: threading.Event) -> None:
    """Block until one of ``calls`` is done or ``stop`` is set, whichever comes first.

    No timer when ``stop`` is a ``WakeableEvent`` (the worker's ``changed`` is one); a
    plain ``Event`` is looked at every 20 ms.
    """
    wake = threading.Event()
    for call in calls:
        call._on_done = _chain(call._on_done, wake.set)
    unsubscribe = stop.subscribe(wake.set) if isinstance(stop, WakeableEvent) else None
    try:
        while not (stop.is_set() or any(c.done.is_set() for c in calls)):
            wake.wait(None if unsubscribe is not None else 0.02)
            wake.clear()
    finally:
        if unsubscribe is not None:
            unsubscribe()


def _chain(first: Callable[[], None] | None, then: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        if first is not None:
            first()
        then()

    return both


def interruptible(fn: Callable[[], T], stop: threading.Event, what: str) -> T:
    """Run ``fn`` on a pool thread; raise ``Interrupted`` as soon as ``stop`` is set.

    The call is abandoned, not killed: it must only touch private copies.
    """
    call = BackgroundCall(fn, f"wait-{what}")
    wait_any([call], stop)
    if not call.done.is_set():
        raise Interrupted(f"configuration changed while waiting for {what}")
    return call.result()


# Tags identify a message within a link of one generation: kind, sending block, step, mb.
ACT, GRAD, BRC_GRAD, SYNC = 1, 2, 3, 4


def first_sentence(exc: BaseException) -> str:
    """gloo's messages run to several sentences; the first one says what happened."""
    first = str(exc).splitlines()[0] if str(exc) else repr(exc)
    return first.split(". ")[0]


def tag(kind: int, block: int, step: int, microbatch: int) -> int:
    return ((kind * 64 + block) * 1024 + step % 1024) * 256 + (microbatch % 256)


class Transport:
    """Messages of one worker in one generation: gloo/NCCL links to peers, a mailbox to itself."""

    def __init__(
        self,
        me: int,
        generation: int,
        backend: str,
        store: dist.Store,
        timeout: timedelta,
        device: torch.device,
        address: str = "127.0.0.1",
    ) -> None:
        self.me = me
        self.address = address
        self.generation = generation
        self.backend = backend
        self.store = store
        self.timeout = timeout
        self.device = device
        self.links: dict[int, Any] = {}
        self._mail: dict[int, torch.Tensor] = {}
        self._mail_cv = threading.Condition()
        self.closed = False

    def connect(self, peers: list[int], stop: threading.Event) -> None:
        # Sorted global order (every link built lowest pair first) cannot deadlock.
        for peer in sorted(peers):
            a, b = sorted((self.me, peer))
            prefix = dist.PrefixStore(f"gen{self.generation}/link{a}-{b}", self.store)
            rank = 0 if self.me == a else 1
            self.links[peer] = self._make_link(peer, prefix, rank, stop)

    def _make_link(self, peer: int, prefix: dist.Store, rank: int, stop: threading.Event) -> Any:
        try:
            return interruptible(
                lambda prefix=prefix, rank=rank: make_group(  # type: ignore[misc]
                    self.backend, prefix, rank, 2, self.timeout, self.address
                ),
                stop,
                f"link to worker {peer} of generation {self.generation}",
            )
        except RuntimeError as exc:
            raise LinkError(peer, first_sentence(exc)) from exc

    def _peer_rank(self, peer: int) -> int:
        return 0 if peer < self.me else 1

    def send(self, peer: int, tag_: int, tensor: torch.Tensor) -> Any:
        if peer == self.me:
            with self._mail_cv:
                self._mail[tag_] = tensor.detach().clone()
                self._mail_cv.notify_all()
            return None
        with self._on_link(peer):
            return self.links[peer].send([tensor.contiguous()], self._peer_rank(peer), tag_)

    def recv(self, peer: int, tag_: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if peer == self.me:
            with self._mail_cv:
                while tag_ not in self._mail:
                    if self.closed:
                        raise Interrupted("transport closed")
                    self._mail_cv.wait(0.1)
                return self._mail.pop(tag_)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        with self._on_link(peer):
            self.links[peer].recv([buf], self._peer_rank(peer), tag_).wait()
        return buf

    @contextlib.contextmanager
    def _on_link(self, peer: int) -> Iterator[None]:
        """A call on the link to ``peer``: no such link, or gloo's error, is a LinkError."""
        try:
            yield
        except KeyError:
            raise LinkError(
                peer, f"no link to worker {peer} in generation {self.generation}"
            ) from None
        except RuntimeError as exc:
            raise LinkError(peer, first_sentence(exc)) from exc

    def close(self) -> None:
        with self._mail_cv:
            self.closed = True
            self._mail_cv.notify_all()


class Groups:
    """All-reduce groups of one generation, built on first use in block order."""

    def __init__(
        self,
        me: int,
        generation: int,
        backend: str,
        store: dist.Store,
        timeout: timedelta,
        address: str = "127.0.0.1",
    ) -> None:
        self.me = me
        self.generation = generation
        self.backend = backend
        self.store = store
        self.timeout = timeout
        self.address = address
        self.groups: dict[int, Any] = {}

    def allreduce(
        self, block: int, members: list[int], flat: torch.Tensor, stop: threading.Event
    ) -> torch.Tensor:
        """Sum of ``flat`` over ``members``; ``flat`` itself is left untouched (the stash a
        failover may all-reduce again). With one member that is ``flat`` itself: callers
        only read the result."""
        if len(members) == 1:
            return flat
        if block not in self.groups:
            prefix = dist.PrefixStore(f"gen{self.generation}/block{block}", self.store)
            rank = members.index(self.me)
            try:
                self.groups[block] = interruptible(
                    lambda: make_group(
                        self.backend, prefix, rank, len(members), self.timeout, self.address
                    ),
                    stop,
                    f"all-reduce group of block {block}",
                )
            except RuntimeError as exc:
                raise LinkError(
                    -1, f"all-reduce group of block {block}: {first_sentence(exc)}"
                ) from exc
        group = self.groups[block]
        work_buf = flat.clone()

        def run() -> torch.Tensor:
            group.allreduce([work_buf]).wait()
            return work_buf

        try:
            return interruptible(run, stop, f"all-reduce of block {block}")
        except RuntimeError as exc:
            # which member failed is not known here; its neighbours or its lease will say
            raise LinkError(-1, f"all-reduce of block {block}: {first_sentence(exc)}") from exc
