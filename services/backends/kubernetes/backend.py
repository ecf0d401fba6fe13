"""The kubernetes backend: every learner is a Pod, placed by our gang scheduler.

Deploy steps, as the backend contract orders them (services/backends/api.py):

- `prepare_volume`: the job's owner ConfigMap `rz-<job>` (everything else is owned by it,
  so deleting it cascades) and its NetworkPolicy (learners reach each other and the
  platform only). No volume: a pod's job directory is an emptyDir, and code and
  checkpoints come from the object store named in its learner spec.
- `write_secrets`: the data-store credentials as the Secret `rz-<job>-secrets`; on a TLS
  platform the job's TDS client certificate as the Secret `rz-<job>-tds-tls`, which every
  learner pod mounts as a directory. `renew_tls` patches it: the kubelet projects the new
  certificate into the running pods, whose log collectors re-read it.
- `start_learner`: the learner spec as a Secret and the Pod (spec.py), both labelled
  with the job, rank, generation and restart. The pod carries `schedulerName: rhizome`:
  our scheduler binds the whole gang (scheduler.py), no other scheduler touches it.

Every call is retried on 429/5xx/connection failures (client.py); a create answered 409
adopts the object when it is this job's, so a retried create never duplicates a pod.
Pods are followed by list+watch (watch.py). `rollback` deletes every object labelled with
the job, listing by selector and deleting by name (never a delete-collection: a server
that ignored the selector would take other jobs' objects with it).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from contract.status import ExitCode
from services.backends.api import Backend, JobSpec, cannot_block, register_backend
from services.backends.kubernetes.api import (
    KubernetesBackendError,
    KubeSettings,
    describe_api_error,
)
from services.backends.kubernetes.client import Calls, api_client, json_body
from services.backends.kubernetes.spec import (
    CONTAINER,
    LABEL_JOB,
    handle_of,
    job_selector,
    network_policy_object,
    owner_object,
    owner_reference,
    pod_object,
    secrets_object,
    spec_secret_object,
    tds_tls_data,
    tds_tls_name,
    tds_tls_object,
)
from services.backends.kubernetes.watch import HOPELESS_WAITING, PodState, PodWatch
from services.backends.local.backend import remove_deploy_files, tail_logs
from services.images.build import learner_tag

log = logging.getLogger(__name__)
# How long `exit_note` waits for a learner's pod to end, so that the kubelet's reason
# (OOMKilled) is known when the guardian writes the failure.
EXIT_NOTE_WAIT_S = 5.0


class KubernetesBackend(Backend):
    name = "kubernetes"
    # A renewed certificate reaches running pods through their TLS Secret volume.
    renews_tls = True

    def __init__(
        self,
        settings: KubeSettings | None = None,
        api: k8s.ApiClient | None = None,
        **_: Any,  # `reaper` and friends of other backends: pods need none
    ) -> None:
        self.settings = settings or KubeSettings.from_environ()
        self.api = api or api_client(self.settings)
        self.core = k8s.CoreV1Api(self.api)
        self.net = k8s.NetworkingV1Api(self.api)
        self.calls = Calls(self.settings)
        self.namespace = self.settings.namespace
        self._lock = threading.Lock()
        self._watches: dict[str, PodWatch] = {}
        self._handles: dict[int, tuple[str, str]] = {}  # handle -> (job id, pod name)
        self._owners: dict[str, dict[str, Any]] = {}  # job id -> owner reference
        self._stuck: dict[tuple[str, int], str] = {}  # (job, rank) -> why its pod failed

    # -- helpers -----------------------------------------------------------------------
    def watch(self, job_id: str) -> PodWatch:
        with self._lock:
            watch = self._watches.get(job_id)
            if watch is None:
                watch = PodWatch(self.core, self.calls, self.namespace, job_id).start()
                self._watches[job_id] = watch
            return watch

    def image_for(self, job: JobSpec) -> str:
        return job.manifest.framework.image or self.settings.image or learner_tag()

    def owner(self, job: JobSpec) -> dict[str, Any] | None:
        """The reference every object of the job carries to its owner ConfigMap (read
        back after a restart of the guardian). None on a server that assigns no uids
        (a real API server always does; a reference without one would be refused)."""
        ref = self._owners.get(job.job_id)
        if ref is None:
            body = owner_object(job, self.namespace)
            created = self.calls.create_or_adopt(
                f"job {job.job_id}: creating its owner ConfigMap",
                self.core.create_namespaced_config_map,
                self.core.read_namespaced_config_map,
                self.namespace,
                body,
                job.job_id,
            )
            ref = self._owners[job.job_id] = owner_reference(created)
        return ref if ref.get("uid") else None

    # -- deploy steps ------------------------------------------------------------------
    def prepare_volume(self, job: JobSpec) -> None:
        owner = self.owner(job)
        policy = network_policy_object(job, self.namespace, self.settings.platform_labels, owner)
        self.calls.create_or_adopt(
            f"job {job.job_id}: creating its NetworkPolicy",
            self.net.create_namespaced_network_policy,
            self.net.read_namespaced_network_policy,
            self.namespace,
            policy,
            job.job_id,
        )

    def write_secrets(self, job: JobSpec) -> None:
        owner = self.owner(job)
        self._write_secret(
            f"job {job.job_id}: writing its Secret", secrets_object(job, self.namespace, owner), job
        )
        if job.tds_tls:
            self._write_secret(
                f"job {job.job_id}: writing its TDS certificate Secret",
                tds_tls_object(job, self.namespace, owner),
                job,
            )

    def _write_secret(self, what: str, body: dict[str, Any], job: JobSpec) -> None:
        existing = self.calls.create_or_adopt(
            what,
            self.core.create_namespaced_secret,
            self.core.read_namespaced_secret,
            self.namespace,
            body,
            job.job_id,
        )
        if existing.get("data") != body["data"]:  # an earlier deploy's: take today's values
            self.calls.call(
                what,
                self.core.patch_namespaced_secret,
                body["metadata"]["name"],
                self.namespace,
                {"data": body["data"]},
                _preload_content=False,
            )

    def renew_tls(self, job: JobSpec, tls: dict[str, str]) -> None:
        """Patch the job's TDS certificate Secret (`rz-<job>-tds-tls`): every learner pod
        mounts it as a directory, so the kubelet projects the new `tds-tls.json` into the
        running pods (atomically, within its sync period: about a minute), where the
        controller's log collector re-reads it (`RenewingStub`). Pods started later mount
        the same Secret. Retried on 409/429/5xx; a Secret that is gone (the job was rolled
        back, or someone deleted it) is a BackendError naming the job."""
        name = tds_tls_name(job.job_id)
        what = f"job {job.job_id}: renewing its learners' TDS certificate (Secret {name})"
        try:
            self.calls.call_retrying_conflicts(
                what,
                self.core.patch_namespaced_secret,
                name,
                self.namespace,
                {"data": tds_tls_data(tls)},
                _preload_content=False,
            )
        except ApiException as exc:
            if exc.status == 404:
                raise KubernetesBackendError(
                    f"{what}: the Secret is gone from namespace {self.namespace}; the job's "
                    "pods were removed, or it was deleted by hand (redeploy the job)"
                ) from exc
            raise KubernetesBackendError(f"{what}: refused: {describe_api_error(exc)}") from exc

    def start_learner(self, job: JobSpec, rank: int, restart: int = 0) -> int:
        what = f"job {job.job_id}: starting learner {rank}"
        owner = self.owner(job)
        watch = self.watch(job.job_id)
        self.calls.create_or_adopt(
            f"{what}: its spec Secret",
            self.core.create_namespaced_secret,
            self.core.read_namespaced_secret,
            self.namespace,
            spec_secret_object(job, rank, restart, self.namespace, owner),
            job.job_id,
        )
        body = pod_object(job, rank, restart, self.namespace, self.image_for(job), owner)
        name = str(body["metadata"]["name"])
        pod = self._create_pod(what, body, job.job_id)
        self._stuck.pop((job.job_id, rank), None)
        watch.note(PodState.from_pod(pod, time.monotonic()))
        handle = handle_of(name)
        self._handles[handle] = (job.job_id, name)
        return handle

    def _create_pod(self, what: str, body: Mapping[str, Any], job_id: str) -> dict[str, Any]:
        """Create the pod; a live pod of the name (a create whose answer was lost) is
        adopted, a finished one (the controller died, the guardian starts it again) is
        replaced once the server has removed it."""
        name = str(body["metadata"]["name"])
        deadline = time.monotonic() + 60
        while True:
            pod = self.calls.create_or_adopt(
                what,
                self.core.create_namespaced_pod,
                self.core.read_namespaced_pod,
                self.namespace,
                body,
                job_id,
            )
            state = PodState.from_pod(pod, 0.0)
            if state.running and not state.terminating:
                return pod
            if time.monotonic() > deadline:
                raise KubernetesBackendError(
                    f"{what}: the finished pod {name} of an earlier run is still being removed"
                )
            self.calls.delete(
                what, self.core.delete_namespaced_pod, name, self.namespace, grace_period_seconds=0
            )
            time.sleep(0.2)

    @cannot_block
    def start_helper(self, job: JobSpec) -> None:
        """Each controller ships its own logs to the TDS; there is no per-job helper."""

    # -- what runs ---------------------------------------------------------------------
    def learner_exited(self, handle: int) -> int | None:
        found = self._handles.get(handle)
        if found is None:
            return None
        job_id, name = found
        state = self.watch(job_id).get(name)
        if state is None:
            return None
        if state.deleted:
            return state.exit_code if state.exit_code is not None else int(ExitCode.KILLED)
        if state.phase == "Succeeded":
            return state.exit_code if state.exit_code is not None else 0
        if state.phase == "Failed":
            if state.exit_code is not None:
                return state.exit_code
            return int(ExitCode.KILLED) if state.reason == "OOMKilled" else int(ExitCode.FAILED)
        if state.phase == "Pending" and self._hopeless(job_id, state):
            self._give_up(job_id, state)
            return int(ExitCode.FAILED)
        return None

    def _hopeless(self, job_id: str, state: PodState) -> bool:
        if state.reason in HOPELESS_WAITING:
            return True
        return time.monotonic() - state.seen_at > self.settings.pending_deadline_s

    def _give_up(self, job_id: str, state: PodState) -> None:
        """A pod that will not start: remember why (exit_note), and remove it."""
        why = state.reason or "not scheduled"
        detail = f": {state.message}" if state.message else ""
        self._stuck[(job_id, state.rank)] = (
            f"its pod {state.name} stayed Pending ({why}{detail})"
            if state.reason not in HOPELESS_WAITING
            else f"its pod {state.name} cannot start ({why}{detail})"
        )
        with contextlib.suppress(KubernetesBackendError):
            self.calls.delete(
                f"job {job_id}: removing the stuck pod {state.name}",
                self.core.delete_namespaced_pod,
                state.name,
                self.namespace,
                grace_period_seconds=0,
            )

    def controller_alive(self, job_id: str, rank: int, status: dict[str, Any]) -> bool:
        """Alive means a pod of the rank that runs and is not being deleted. While the
        watch is not synced we cannot tell: answer alive and let the lease decide."""
        watch = self.watch(job_id)
        if not watch.synced.wait(timeout=2.0):
            return True
        return any(s.running and not s.terminating and s.rank == rank for s in watch.states())

    def _ended_pod(self, job_id: str, rank: int) -> PodState | None:
        last = self._last_pod(job_id, rank)
        deadline = time.monotonic() + EXIT_NOTE_WAIT_S
        # The controller records its learner's failure just before its container ends: the
        # kubelet's reason for that end (OOMKilled) may be a moment behind. Wait for it.
        while last is not None and last.running and time.monotonic() < deadline:
            time.sleep(0.1)
            last = self._last_pod(job_id, rank)
        return last

    def out_of_memory(self, job_id: str, rank: int) -> bool:
        last = self._ended_pod(job_id, rank)
        return last is not None and last.reason == "OOMKilled"

    def exit_note(self, job_id: str, rank: int) -> str:
        stuck = self._stuck.get((job_id, rank))
        if stuck:
            return stuck
        last = self._ended_pod(job_id, rank)
        if last is None:
            return ""
        if last.reason == "OOMKilled":
            limit = f" of {last.memory_limit}" if last.memory_limit else ""
            return f"out of memory: the learner's pod hit its memory limit{limit} (OOM kill)"
        if last.node_lost:
            node = f" {last.node}" if last.node else ""
            return f"its node{node} was lost ({last.reason or 'DisruptionTarget'})"
        return ""

    def _last_pod(self, job_id: str, rank: int) -> PodState | None:
        states = [s for s in self.watch(job_id).states() if s.rank == rank]
        return max(states, key=lambda s: (s.generation, s.restart)) if states else None

    def running(self, job_id: str) -> list[int]:
        return [handle_of(str(p["metadata"]["name"])) for p in self._live_pods(job_id)]

    def _list(self, what: str, fn: Callable[..., Any], job_id: str) -> list[dict[str, Any]]:
        body = json_body(
            self.calls.call(
                what,
                fn,
                self.namespace,
                label_selector=job_selector(job_id),
                _preload_content=False,
            )
        )
        # Checked again here: a server that ignored the selector must not hand us
        # another job's objects to delete.
        return [
            item
            for item in body.get("items") or []
            if ((item.get("metadata") or {}).get("labels") or {}).get(LABEL_JOB) == job_id
        ]

    def _live_pods(self, job_id: str) -> list[dict[str, Any]]:
        pods = self._list(f"job {job_id}: listing pods", self.core.list_namespaced_pod, job_id)
        out = []
        for pod in pods:
            state = PodState.from_pod(pod, 0.0)
            if state.running and not state.terminating:
                out.append(pod)
        return out

    def log_tail(self, job_dir: str, rank: int, lines: int = 20) -> list[str]:
        """The controller's output from the newest pod of the rank (the command's own
        streams reach the TDS through the controller's collector)."""
        job_id = _job_of_dir(job_dir)
        states = [s for s in self.watch(job_id).states() if s.rank == rank] if job_id else []
        if not states:
            return tail_logs(job_dir, rank, lines)
        last = max(states, key=lambda s: (s.generation, s.restart))
        try:
            text = self.core.read_namespaced_pod_log(
                last.name, self.namespace, container=CONTAINER, tail_lines=lines
            )
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            log.info("job %s: no log of pod %s: %s", job_id, last.name, exc)
            return tail_logs(job_dir, rank, lines)
        return [f"[pod] {line}" for line in str(text or "").splitlines()[-lines:]]

    # -- undo ----------------------------------------------------------------------------
    def stop_learner(self, job_id: str, rank: int, grace_s: float) -> None:
        """Delete the rank's running pod with the grace (an elastic job's scale-in: the
        kubelet's SIGTERM reaches the worker, which leaves at the end of a mini-batch);
        waits until it is gone or the grace (plus a margin) has passed."""
        self._delete_pods(
            job_id,
            [
                str(p["metadata"]["name"])
                for p in self._live_pods(job_id)
                if PodState.from_pod(p, 0.0).rank == rank
            ],
            grace_s,
        )

    def stop_learners(self, job_id: str, grace_s: float) -> None:
        """Delete the job's running pods with the grace: the kubelet sends SIGTERM (the
        controller passes it to the command, which saves), SIGKILL after it. Waits until
        they are gone or the grace (plus a margin) has passed."""
        self._delete_pods(
            job_id, [str(p["metadata"]["name"]) for p in self._live_pods(job_id)], grace_s
        )

    def _delete_pods(self, job_id: str, names: list[str], grace_s: float) -> None:
        grace = max(1, math.ceil(grace_s))
        for name in names:
            self.calls.delete(
                f"job {job_id}: stopping pod {name}",
                self.core.delete_namespaced_pod,
                name,
                self.namespace,
                grace_period_seconds=grace,
            )
        deadline = time.monotonic() + grace + 5
        watch = self.watch(job_id)
        while names and time.monotonic() < deadline:
            left = [n for n in names if (s := watch.get(n)) is not None and not s.deleted]
            if not left:
                break
            watch.changed.wait(0.2)
            watch.changed.clear()

    def rollback(self, job_id: str, job_dir: str) -> None:
        """Delete every pod, Secret (the TDS certificate's too), NetworkPolicy and
        ConfigMap labelled with the job; then the deploy's local files. Safe at any point,
        any number of times. A server that cannot be reached raises (after the retries):
        objects left running would hold the cluster, so the guardian must try again."""
        kinds: list[tuple[str, Callable[..., Any], Callable[..., Any], dict[str, Any]]] = [
            (
                "pod",
                self.core.list_namespaced_pod,
                self.core.delete_namespaced_pod,
                {"grace_period_seconds": 0},
            ),
            (
                "NetworkPolicy",
                self.net.list_namespaced_network_policy,
                self.net.delete_namespaced_network_policy,
                {},
            ),
            ("Secret", self.core.list_namespaced_secret, self.core.delete_namespaced_secret, {}),
            (
                "ConfigMap",
                self.core.list_namespaced_config_map,
                self.core.delete_namespaced_config_map,
                {"propagation_policy": "Background"},
            ),
        ]
        for kind, lister, deleter, options in kinds:
            for item in self._list(f"job {job_id}: rollback: listing {kind}s", lister, job_id):
                name = str(item["metadata"]["name"])
                self.calls.delete(
                    f"job {job_id}: rollback: deleting {kind} {name}",
                    deleter,
                    name,
                    self.namespace,
                    **options,
                )
        self._owners.pop(job_id, None)
        # Nothing of the job is left to follow; a later deploy starts a new watch.
        with self._lock:
            watch = self._watches.pop(job_id, None)
        if watch is not None:
            watch.stop()
        for key in [k for k in self._stuck if k[0] == job_id]:
            self._stuck.pop(key, None)
        if job_dir:
            remove_deploy_files(job_dir)

    def close(self) -> None:
        for watch in list(self._watches.values()):
            watch.stop()
        self._watches.clear()
        with contextlib.suppress(Exception):
            self.api.close()


def _job_of_dir(job_dir: str) -> str:
    """The guardian names a job's directory after the job (`<data>/jobs/<job>`)."""
    return job_dir.rstrip("/").rsplit("/", 1)[-1] if job_dir else ""


register_backend("kubernetes", KubernetesBackend)

__all__ = ["KubernetesBackend"]
