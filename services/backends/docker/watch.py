"""A job's containers as the engine reports them: its event stream, filtered by the job's
label, plus a full re-list by label every time the stream (re)starts.

The stream is opened first and the re-list made after, so an event between the two is
seen twice (applying it is idempotent) rather than never; a stream that breaks (the
engine restarted, the connection dropped) is reopened with a new re-list, so nothing
that happened meanwhile is missed. What the guardian asks — did this container exit and
with what code, does a controller of this rank run, was it OOM-killed — is answered from
this view without a call to the engine.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import docker

from services.backends.docker.spec import LABEL_GENERATION, LABEL_JOB, LABEL_RANK, job_filter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContainerState:
    id: str
    name: str
    rank: int
    generation: int
    running: bool
    exit_code: int | None = None
    oom: bool = False
    removed: bool = False

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> ContainerState:
        labels = (attrs.get("Config") or {}).get("Labels") or {}
        state = attrs.get("State") or {}
        running = bool(state.get("Running"))
        status = str(state.get("Status", ""))
        exited = not running and status in ("exited", "dead")
        return cls(
            id=str(attrs["Id"]),
            name=str(attrs.get("Name", "")).lstrip("/"),
            rank=int(labels.get(LABEL_RANK, -1)),
            generation=int(labels.get(LABEL_GENERATION, 0)),
            running=running,
            exit_code=int(state.get("ExitCode", 0)) if exited else None,
            oom=bool(state.get("OOMKilled")),
        )


class JobWatch:
    def __init__(
        self, connect: Callable[[], docker.DockerClient], job_id: str, retry_s: float = 0.5
    ) -> None:
        self.connect = connect
        self.job_id = job_id
        self.retry_s = retry_s
        self.synced = threading.Event()
        self.relists = 0  # how many times the stream (re)started with a full re-list
        self.changed = threading.Event()
        self._states: dict[str, ContainerState] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stream: Any = None
        self._thread: threading.Thread | None = None

    # -- life ---------------------------------------------------------------------------
    def start(self) -> JobWatch:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"docker-events-{self.job_id}", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        stream = self._stream
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            client = None
            try:
                client = self.connect()
                # Subscribe first, re-list second: nothing falls between the two.
                self._stream = client.api.events(
                    decode=True, filters={"type": "container", **job_filter(self.job_id)}
                )
                self._relist(client)
                self.synced.set()
                for event in self._stream:
                    if self._stop.is_set():
                        break
                    self.apply(event)
            except Exception as exc:  # the engine went away: reopen and re-list
                if not self._stop.is_set():
                    log.info("job %s: docker event stream broke (%s); reopening", self.job_id, exc)
            finally:
                self.synced.clear()
                if self._stream is not None:
                    with contextlib.suppress(Exception):
                        self._stream.close()
                    self._stream = None
                if client is not None:
                    with contextlib.suppress(Exception):
                        client.close()
            self._stop.wait(self.retry_s)

    # -- the view ------------------------------------------------------------------------
    def _relist(self, client: docker.DockerClient) -> None:
        found: dict[str, ContainerState] = {}
        for summary in client.api.containers(all=True, filters=job_filter(self.job_id)):
            with contextlib.suppress(docker.errors.NotFound):
                state = ContainerState.from_attrs(client.api.inspect_container(summary["Id"]))
                found[state.id] = state
        with self._lock:
            for cid, old in self._states.items():
                if cid not in found:  # removed while we were not listening
                    found[cid] = replace(old, running=False, removed=True)
            self._states = found
            self.relists += 1
        self.changed.set()

    def apply(self, event: dict[str, Any]) -> None:
        """One engine event (`docker events` JSON) into the view; idempotent."""
        action = str(event.get("Action") or event.get("status") or "")
        cid = str(event.get("id") or (event.get("Actor") or {}).get("ID") or "")
        attrs = (event.get("Actor") or {}).get("Attributes") or {}
        if not cid or attrs.get(LABEL_JOB, self.job_id) != self.job_id:
            return
        with self._lock:
            old = self._states.get(cid) or ContainerState(
                id=cid,
                name=str(attrs.get("name", "")),
                rank=int(attrs.get(LABEL_RANK, -1)),
                generation=int(attrs.get(LABEL_GENERATION, 0)),
                running=False,
            )
            if action == "start":
                new = replace(old, running=True, exit_code=None, oom=False, removed=False)
            elif action == "die":
                code = attrs.get("exitCode")
                new = replace(old, running=False, exit_code=int(code) if code else 0)
            elif action == "oom":
                new = replace(old, oom=True)
            elif action == "destroy":
                new = replace(old, running=False, removed=True)
            elif action == "create":
                new = old
            else:
                return
            self._states[cid] = new
        self.changed.set()

    def note(self, state: ContainerState) -> None:
        """A container this process just started (unless an event already told us more)."""
        with self._lock:
            self._states.setdefault(state.id, state)

    def states(self) -> list[ContainerState]:
        with self._lock:
            return list(self._states.values())

    def find(self, id_prefix: str) -> ContainerState | None:
        with self._lock:
            for cid, state in self._states.items():
                if cid.startswith(id_prefix):
                    return state
        return None
