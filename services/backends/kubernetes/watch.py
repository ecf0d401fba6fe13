"""A job's pods as the API server reports them: list, then watch from the list's
resourceVersion; 410 Gone (the version was compacted away) or a broken stream means list
again, so a change during a restart of the guardian, the daemon or the API server is
never missed. Events are applied idempotently (a relist may replay them).

What the guardian asks — did this pod's learner exit and with what code, does a
controller of this rank run, why did it end (OOM kill, node lost, stuck Pending) — is
answered from this view without a call to the server.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Self

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from services.backends.kubernetes.client import Calls, json_body
from services.backends.kubernetes.spec import (
    CONTAINER,
    LABEL_GENERATION,
    LABEL_JOB,
    LABEL_RANK,
    LABEL_RESTART,
    job_selector,
)

log = logging.getLogger(__name__)

# Waiting reasons that will not fix themselves: the pod fails at once, with the reason.
HOPELESS_WAITING = frozenset(
    {"InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError"}
)
# Waiting reasons worth the pending deadline (a registry hiccup, a slow pull).
STUCK_WAITING = frozenset({"ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff"})
NODE_LOSS_REASONS = frozenset({"NodeLost", "Evicted", "Terminated", "Shutdown", "NodeShutdown"})


class Gone(Exception):
    """410: the resourceVersion we watch from is too old; list again."""


@dataclass(frozen=True)
class PodState:
    name: str
    rank: int
    generation: int
    restart: int
    phase: str = "Pending"
    node: str = ""
    exit_code: int | None = None
    reason: str = ""  # the container's terminated or waiting reason, or the pod's
    message: str = ""
    deleted: bool = False
    terminating: bool = False
    node_lost: bool = False
    seen_at: float = 0.0  # monotonic time this process first saw it
    memory_limit: str = ""  # the container's, for an OOM kill's note (the pod may be gone)

    @property
    def running(self) -> bool:
        return not self.deleted and self.phase in ("Pending", "Running")

    @classmethod
    def from_pod(cls, pod: dict[str, Any], seen_at: float, deleted: bool = False) -> PodState:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        spec = pod.get("spec") or {}
        status = pod.get("status") or {}
        phase = str(status.get("phase") or "Pending")
        exit_code: int | None = None
        reason = str(status.get("reason") or "")
        message = str(status.get("message") or "")
        for cs in status.get("containerStatuses") or []:
            if cs.get("name") != CONTAINER:
                continue
            state = cs.get("state") or {}
            if state.get("terminated"):
                term = state["terminated"]
                exit_code = int(term.get("exitCode", 1))
                reason = str(term.get("reason") or reason)
                message = str(term.get("message") or message)
            elif state.get("waiting"):
                wait = state["waiting"]
                reason = str(wait.get("reason") or reason)
                message = str(wait.get("message") or message)
        if not reason:
            for cond in status.get("conditions") or []:
                if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                    reason = str(cond.get("reason") or "Unschedulable")
                    message = str(cond.get("message") or "")
        memory_limit = ""
        for container in spec.get("containers") or []:
            if container.get("name") == CONTAINER:
                limits = (container.get("resources") or {}).get("limits") or {}
                memory_limit = str(limits.get("memory") or "")
        disrupted = any(
            c.get("type") == "DisruptionTarget" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        return cls(
            name=str(meta.get("name", "")),
            rank=int(labels.get(LABEL_RANK, -1)),
            generation=int(labels.get(LABEL_GENERATION, 0)),
            restart=int(labels.get(LABEL_RESTART, 0)),
            phase=phase,
            node=str(spec.get("nodeName") or ""),
            exit_code=exit_code,
            reason=reason,
            message=message,
            deleted=deleted,
            terminating=bool(meta.get("deletionTimestamp")),
            node_lost=disrupted or str(status.get("reason") or "") in NODE_LOSS_REASONS,
            seen_at=seen_at,
            memory_limit=memory_limit,
        )


class ListWatch:
    """List, then watch from the list's resourceVersion, in a thread; 410 or a broken
    stream lists again. Subclasses say what to list (`list_call`) and keep the view
    (`replace_all` after a list, `apply_object` per event)."""

    def __init__(
        self,
        calls: Calls,
        name: str,
        list_call: Callable[..., Any],
        list_args: tuple[Any, ...] = (),
        label_selector: str = "",
        watch_timeout_s: int = 30,
        retry_s: float = 0.5,
    ) -> None:
        self.calls = calls
        self.name = name
        self.list_call = list_call
        self.list_args = list_args
        self.label_selector = label_selector
        self.watch_timeout_s = watch_timeout_s
        self.retry_s = retry_s
        self.synced = threading.Event()
        self.changed = threading.Event()
        self.relists = 0  # full lists made (the first, then one per 410 or broken stream)
        self.gone = 0  # 410s answered with a relist
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._resp: Any = None
        self._thread: threading.Thread | None = None

    # -- what subclasses keep -----------------------------------------------------------
    def replace_all(self, items: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def apply_object(self, kind: str, obj: dict[str, Any]) -> None:
        raise NotImplementedError

    # -- life ---------------------------------------------------------------------------
    def start(self) -> Self:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        resp = self._resp
        if resp is not None:
            # shutdown() wakes a read blocked in the watch thread; close() alone does not.
            with contextlib.suppress(Exception):
                resp.shutdown()
            with contextlib.suppress(Exception):
                resp.close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                version = self._relist()
                self.synced.set()
                while not self._stop.is_set():
                    opened = time.monotonic()
                    version = self._watch_once(version)
                    if time.monotonic() - opened < 1.0:
                        # A server that ends streams at once must not make us spin.
                        self._stop.wait(self.retry_s)
            except Gone:
                self.gone += 1
                log.info("%s: watch expired (410 Gone); listing again", self.name)
                continue
            except Exception as exc:  # the server went away: list again when it is back
                if not self._stop.is_set():
                    log.info("%s: watch broke (%s); listing again", self.name, exc)
            self.synced.clear()
            self._stop.wait(self.retry_s)

    def _selector(self) -> dict[str, Any]:
        return {"label_selector": self.label_selector} if self.label_selector else {}

    def _relist(self) -> str:
        body = json_body(
            self.calls.call(
                f"{self.name}: listing",
                self.list_call,
                *self.list_args,
                **self._selector(),
                _preload_content=False,
            )
        )
        self.replace_all(list(body.get("items") or []))
        with self._lock:
            self.relists += 1
        self.changed.set()
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    def _watch_once(self, version: str) -> str:
        kwargs: dict[str, Any] = {
            **self._selector(),
            "watch": True,
            "allow_watch_bookmarks": True,
            "timeout_seconds": self.watch_timeout_s,
            "_preload_content": False,
            # A server that ignores timeout_seconds must not hold us forever.
            "_request_timeout": (5, self.watch_timeout_s + 5),
        }
        if version:
            kwargs["resource_version"] = version
        try:
            resp: Any = self.list_call(*self.list_args, **kwargs)
        except ApiException as exc:
            if exc.status == 410:
                raise Gone() from exc
            raise
        self._resp = resp
        try:
            for line in iter_resp_lines(resp):
                if self._stop.is_set():
                    break
                if not line:
                    continue
                version = self.apply(json.loads(line), version)
        except Exception as exc:
            if _is_read_timeout(exc):
                return version  # a quiet stream ended by our own read timeout
            raise
        finally:
            self._resp = None
            with contextlib.suppress(Exception):
                resp.close()
                resp.release_conn()
        return version

    def apply(self, event: dict[str, Any], version: str = "") -> str:
        """One watch event into the view; returns the resourceVersion to go on from."""
        kind = str(event.get("type") or "")
        obj = event.get("object") or {}
        if kind == "ERROR":
            if int(obj.get("code") or 0) == 410:
                raise Gone()
            raise RuntimeError(f"watch error: {obj.get('reason')}: {obj.get('message')}")
        new_version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
        if kind != "BOOKMARK":
            self.apply_object(kind, obj)
            self.changed.set()
        return new_version


class PodWatch(ListWatch):
    """One job's pods."""

    def __init__(self, core: k8s.CoreV1Api, calls: Calls, namespace: str, job_id: str) -> None:
        super().__init__(
            calls,
            f"job {job_id}: pods",
            core.list_namespaced_pod,
            (namespace,),
            label_selector=job_selector(job_id),
        )
        self.job_id = job_id
        self._states: dict[str, PodState] = {}

    def replace_all(self, items: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        found: dict[str, PodState] = {}
        for pod in items:
            if _job_of(pod) != self.job_id:
                continue  # a server that ignores selectors: never adopt another job's pod
            state = PodState.from_pod(pod, now)
            found[state.name] = state
        with self._lock:
            for name, old in self._states.items():
                if name in found:
                    found[name] = replace(found[name], seen_at=old.seen_at)
                else:  # removed while we were not listening
                    found[name] = replace(old, deleted=True)
            self._states = found

    def apply_object(self, kind: str, obj: dict[str, Any]) -> None:
        if _job_of(obj) != self.job_id:
            return
        state = PodState.from_pod(obj, time.monotonic(), deleted=kind == "DELETED")
        with self._lock:
            old = self._states.get(state.name)
            if old is not None:
                state = replace(
                    state,
                    seen_at=old.seen_at,
                    # A lost node stays the reason after the pod is gone.
                    node_lost=state.node_lost or old.node_lost,
                    exit_code=state.exit_code if state.exit_code is not None else old.exit_code,
                )
            self._states[state.name] = state

    def note(self, state: PodState) -> None:
        """A pod this process just created (unless the stream already told us more)."""
        with self._lock:
            self._states.setdefault(state.name, state)

    def states(self) -> list[PodState]:
        with self._lock:
            return list(self._states.values())

    def get(self, name: str) -> PodState | None:
        with self._lock:
            return self._states.get(name)


def _job_of(pod: dict[str, Any]) -> str:
    return str(((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_JOB, ""))


def _is_read_timeout(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if "ReadTimeout" in type(seen).__name__ or "timed out" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
