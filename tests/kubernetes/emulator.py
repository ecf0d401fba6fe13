"""A Kubernetes API emulator for the tests: kmock's `KubernetesEmulator` served on a free
127.0.0.1 port from a thread, with the few things the backend needs that kmock lacks
filled in HERE (test code), never in the product:

- every created object gets a `uid`, a `resourceVersion` and a `creationTimestamp`
  (kmock stores the body as sent), so owner references are realistic;
- the Binding subresource (`POST pods/NAME/binding`) sets the pod's `spec.nodeName`,
  answering 409 when the pod is already bound, as the real API server does;
- faults on demand: the next N requests (of one resource: `fail_only`) answer
  429/500 (`fail_next`), the next watch
  ends with a 410 Gone ERROR event (`gone_next`), and the server can be stopped and
  started again on the same port with its objects kept (`restart`), like an API server
  restarting over the same etcd.

kmock ignores label selectors: tests filter what they read by label themselves (the
product sends selectors and checks labels again).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import json
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import attrs
from kmock import KubernetesEmulator, Server
from kmock._internal import enums, rendering
from kmock._internal.k8s import KubernetesError, KubernetesObjectNotFoundError

from contract.procs import free_port


@attrs.define(kw_only=True)
class RhizomeEmulator(KubernetesEmulator):
    fail_next: list[int] = attrs.field(factory=list)
    # when set, only requests for this resource (plural) get `fail_next`'s answers: the
    # product's own watches run meanwhile and would take a fault meant for one call
    fail_only: str = ""
    gone_next: int = 0
    gone_only: str = ""  # when set, only watches of this resource (plural) get the 410
    # Graceful pod deletion as the real API server does it when a kubelet runs the pod: a
    # DELETE of a bound pod with a grace period only sets deletionTimestamp; the kubelet
    # (tests/kubernetes/kubelet.py) stops the containers, reports their end, and deletes
    # with grace 0. Off by default: without a kubelet, nothing would ever finish it.
    graceful_pods: bool = False
    bindings: list[tuple[str, str]] = attrs.field(factory=list)  # (pod, node) bound
    _versions: Any = attrs.field(factory=lambda: itertools.count(1000))
    closing: asyncio.Event = attrs.field(factory=asyncio.Event)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if (
            self.fail_next
            and request.resource is not None
            and (not self.fail_only or request.resource.plural == self.fail_only)
        ):
            status = self.fail_next.pop(0)
            raise KubernetesError(status=status, reason="Injected", message=f"injected {status}")
        if request.resource is not None and request.action == enums.action.CREATE:
            meta = request.data.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))
            meta["resourceVersion"] = str(next(self._versions))
            meta.setdefault(
                "creationTimestamp",
                datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            )
        if (
            self.graceful_pods
            and request.resource is not None
            and request.resource.plural == "pods"
            and request.action == enums.action.DELETE
            and request.name is not None
            and not request.subresource
        ):
            return await self._delete_pod(request)
        if (
            request.resource is not None
            and request.resource.plural == "pods"
            and request.subresource == "binding"
            and str(request.method).upper().endswith("POST")
        ):
            return await self._bind(request)
        return await super()._handle(request)

    async def _bind(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        assert request.resource is not None
        key = (request.resource, request.namespace, str(request.name or ""))
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                raise KubernetesObjectNotFoundError()
            pod = self._objects[key]
            if (pod.get("spec") or {}).get("nodeName"):
                raise KubernetesError(
                    status=409, reason="Conflict", message=f"pod {request.name} is already assigned"
                )
            node = str(((request.data or {}).get("target") or {}).get("name") or "")
            pod.patch({"spec": {"nodeName": node}})
            self.bindings.append((str(request.name), node))
            await self._buses[request.resource].put({"type": "MODIFIED", "object": pod.raw})
        return aiohttp.web.json_response(
            {"apiVersion": "v1", "kind": "Status", "status": "Success", "code": 201}, status=201
        )

    async def _delete_pod(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        assert request.resource is not None
        key = (request.resource, request.namespace, str(request.name or ""))
        body = request.data if isinstance(request.data, dict) else {}
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                raise KubernetesObjectNotFoundError()
            pod = self._objects[key]
            spec = pod.get("spec") or {}
            given = request.params.get("gracePeriodSeconds", body.get("gracePeriodSeconds"))
            grace = (
                int(given)
                if given is not None
                else int(spec.get("terminationGracePeriodSeconds", 30))
            )
            if grace == 0 or not spec.get("nodeName"):
                pod.delete()  # no kubelet runs it (or the kubelet is done): gone now
                raw = pod.last.raw
                await self._buses[request.resource].put({"type": "DELETED", "object": raw})
                return aiohttp.web.json_response(raw)
            if not (pod.get("metadata") or {}).get("deletionTimestamp"):
                now = datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                pod.patch(
                    {"metadata": {"deletionTimestamp": now, "deletionGracePeriodSeconds": grace}}
                )
                await self._buses[request.resource].put({"type": "MODIFIED", "object": pod.raw})
            return aiohttp.web.json_response(pod.raw)

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        plural = request.resource.plural if request.resource is not None else ""
        if self.gone_next > 0 and self.gone_only in ("", plural):
            self.gone_next -= 1
            yield b""
            yield {
                "type": "ERROR",
                "object": {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "code": 410,
                    "reason": "Expired",
                    "message": "too old resource version",
                },
            }
            return
        # kmock's own watch subscribes to its event bus only after sending the snapshot,
        # so a change in between is lost; a real API server has no such gap (it resumes
        # from a resourceVersion). Subscribe first, then snapshot, under the same lock.
        # Streams also end when the server is halted: aiohttp would otherwise wait.
        assert request.resource is not None
        yield b""
        bus = self._buses[request.resource]
        async with self._lock:
            marker = await bus.mark()
            objs = self._KubernetesEmulator__get_objs(request, strict=False)  # type: ignore[attr-defined]
            events = [{"type": "ADDED", "object": o.raw} for o in objs if not o.deleted]
        try:
            for event in events:
                yield event
            stream = bus.stream(since=marker).__aiter__()
            closing = asyncio.ensure_future(self.closing.wait())
            step: asyncio.Future[Any] | None = None
            try:
                while True:
                    step = asyncio.ensure_future(stream.__anext__())
                    done, _ = await asyncio.wait(
                        {step, closing}, return_when=asyncio.FIRST_COMPLETED
                    )
                    if step not in done:
                        return
                    try:
                        event = step.result()
                    except StopAsyncIteration:
                        return
                    meta = (event.get("object") or {}).get("metadata") or {}
                    if self._KubernetesEmulator__check(  # type: ignore[attr-defined]
                        request,
                        request.resource,
                        meta.get("namespace"),
                        meta.get("name"),
                        strict=False,
                    ):
                        yield event
            finally:
                closing.cancel()
                # Halted, or the client went away (we are cancelled): the pending read
                # must end before its bus mark goes, or it fails reading a gone mark.
                if step is not None and not step.done():
                    step.cancel()
                    with contextlib.suppress(BaseException):
                        await step
        finally:
            await bus.unmark(marker)


class Emulator:
    """The emulator in a thread of its own: `url` for the client, `km` for assertions."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.km = RhizomeEmulator()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: Server | None = None

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def start(self) -> Emulator:
        self._thread.start()

        async def enter() -> None:
            await self.km.__aenter__()
            self.km.resources.load_bundled()

        self._run(enter())
        self.serve()
        return self

    def serve(self) -> None:
        async def up() -> None:
            self.km.closing.clear()
            self._server = Server(self.km, port=self.port)
            await self._server.__aenter__()

        self._run(up())

    def halt(self) -> None:
        """Stop answering (the API server is down); objects stay."""

        async def down() -> None:
            self.km.closing.set()
            if self._server is not None:
                with contextlib.suppress(Exception):
                    await self._server.__aexit__(None, None, None)
                self._server = None

        self._run(down())

    def restart(self) -> None:
        self.halt()
        self.serve()

    def stop(self) -> None:
        self.halt()

        async def leave() -> None:
            # kmock re-raises the errors it answered (our injected ones, 404s) on exit.
            with contextlib.suppress(BaseException):
                await self.km.__aexit__(None, None, None)

        async def cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self._run(leave())
        with contextlib.suppress(Exception):
            self._run(cancel_rest())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    # -- what the server holds (filtered by label: kmock ignores selectors) ----------------
    def objects(self, plural: str, job_id: str | None = None) -> list[dict[str, Any]]:
        out = []
        for (resource, _ns, _name), obj in list(self.km.objects.items()):
            if resource.plural != plural or obj.deleted:
                continue
            raw = json.loads(json.dumps(obj.raw))
            labels = (raw.get("metadata") or {}).get("labels") or {}
            if job_id is None or labels.get("rhizome.io/job") == job_id:
                out.append(raw)
        return out

    def seed(self, objects: list[dict[str, Any]]) -> None:
        """Store cluster-scoped objects (Nodes) straight into the emulator, as if created
        earlier: a benchmark's 1,000 nodes in a second instead of 1,000 POSTs. Clients
        still list and watch them over HTTP."""
        from kmock import resource

        async def put() -> None:
            async with self.km._lock:
                for obj in objects:
                    plural = f"{str(obj['kind']).lower()}s"
                    key = (resource("", "v1", plural), None, str(obj["metadata"]["name"]))
                    self.km.objects[key] = obj

        self._run(put())
