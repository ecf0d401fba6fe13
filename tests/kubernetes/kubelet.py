"""A kubelet EMULATOR for the daemon-level tests (test code, never the product).

The API emulator (kmock) has no kubelets, so a pod bound to a node never runs. This plays
every node's kubelet from one thread of the test process:

- a pod bound to a node (`spec.nodeName`) gets a directory of its own standing in for
  its volumes: the job emptyDir, the learner spec Secret and the job's Secret written out
  (mode 0400), the pod's paths in the spec rewritten to that directory;
- its container command (`python -m learner.controller --spec ...`) runs as a local
  process in a session of its own, and the pod's status follows it through the API
  (Running, then Succeeded or Failed with the exit code), as a kubelet reports it;
- a pod deleted under a running process gets SIGTERM, then SIGKILL after its grace
  period (what `signals` records), as a kubelet does on a node's termination notice;
  with the API emulator's `graceful_pods`, the deletion waits for that: the kubelet
  reports the container's end on the pod, then deletes it with grace 0;
- `outcomes` scripts what a pod ends with instead of running it (an OOM kill: the
  container terminated with reason OOMKilled and exit code 137).

It polls the pod list (0.1 s) rather than watching: test code kept simple; the product's
watches are what the tests exercise.
"""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from kubernetes import client as k8s

from services.backends.kubernetes.api import KubeSettings
from services.backends.kubernetes.client import api_client, json_body
from services.backends.kubernetes.spec import CONTAINER, POD_JOB_DIR, POD_SPEC_DIR

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Outcome:
    """What a scripted pod ends with: a terminated container after `after_s` running."""

    exit_code: int
    reason: str = "Error"
    after_s: float = 0.5


@dataclass
class OomKill:
    """The container really runs; once its output shows `when_output`, the learner's
    command (the controller's children: the biggest processes in the pod) is SIGKILLed
    as the kernel's OOM killer would, and the container's end is reported as
    `OOMKilled`, as the container runtime does after an OOM kill in the pod's cgroup."""

    when_output: str = "step 0"


@dataclass
class _Running:
    name: str
    uid: str
    namespace: str
    proc: subprocess.Popen[bytes] | None
    grace_s: float
    outcome: Outcome | None = None
    started: float = field(default_factory=time.monotonic)
    log: Any = None
    oom: OomKill | None = None
    oom_killed: bool = False


class KubeletEmulator:
    def __init__(self, settings: KubeSettings, root: Path) -> None:
        self.core = k8s.CoreV1Api(api_client(settings))
        self.namespace = settings.namespace
        self.root = root
        self.outcomes: dict[str, Outcome | OomKill] = {}  # job id -> what its pods end with
        self.default_outcome: Outcome | OomKill | None = None  # every other pod's, when set
        # pod name -> the signals sent to its process on deletion, in order
        self.signals: dict[str, list[str]] = {}
        self.started: list[str] = []  # pods whose container ran (or was scripted)
        self._running: dict[str, _Running] = {}
        self._seen: set[str] = set()  # pod uids started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kubelet-emulator", daemon=True)

    def start(self) -> KubeletEmulator:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for run in list(self._running.values()):
            if run.proc is not None and run.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.proc.pid, signal.SIGKILL)
                run.proc.wait(timeout=10)

    def output(self, pod: str) -> str:
        """What the pod's container wrote: the controller's own output, then the user
        command's stdout (in the job emptyDir, `learners/<rank>/stdout.log`)."""
        out = []
        for here in sorted(self.root.glob(f"{pod}-*")):
            logs = sorted((here / "job" / "learners").glob("*/stdout.log"))
            out += [p.read_text(errors="replace") for p in [here / "container.log", *logs]]
        return "".join(out)

    # -- the loop ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._round()
            except Exception:  # the API emulator restarting: try again next round
                pass
            self._stop.wait(0.1)

    def _round(self) -> None:
        body = json_body(self.core.list_namespaced_pod(self.namespace, _preload_content=False))
        pods = {p["metadata"]["name"]: p for p in body.get("items") or []}
        for name, run in list(self._running.items()):
            pod = pods.get(name)
            if pod is None or pod["metadata"].get("uid") != run.uid:
                self._terminate(run)  # removed at once: nothing left to report to
                if run.log is not None:
                    run.log.close()
                continue
            if pod["metadata"].get("deletionTimestamp"):
                # Graceful deletion: stop the container, report its end, then finish the
                # deletion (grace 0), as a kubelet does.
                self._terminate(run)
                self._report(run, ended=True)
                with contextlib.suppress(k8s.exceptions.ApiException):
                    self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)
                continue
            self._report(run)
        for name, pod in pods.items():
            if pod["metadata"].get("deletionTimestamp") and name not in self._running:
                # Never ran here (scripted, or ended already): nothing to stop.
                with contextlib.suppress(k8s.exceptions.ApiException):
                    self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)
        for pod in pods.values():
            meta, spec = pod["metadata"], pod.get("spec") or {}
            # By uid: a pod deleted and created again under its name is a new pod.
            if meta.get("uid") in self._seen or not spec.get("nodeName"):
                continue
            if meta.get("deletionTimestamp") or meta["name"] in self._running:
                continue
            self._seen.add(meta.get("uid"))
            self._start(pod)

    # -- one pod ----------------------------------------------------------------------
    def _start(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        name, job = meta["name"], meta["labels"]["rhizome.io/job"]
        grace = float(spec.get("terminationGracePeriodSeconds", 30))
        self.started.append(name)
        outcome = self.outcomes.get(job, self.default_outcome)
        if isinstance(outcome, Outcome):
            self._running[name] = _Running(
                name, meta["uid"], meta["namespace"], None, grace, outcome
            )
            self._status(name, "Running", {"running": {"startedAt": _now()}})
            return
        here = self.root / f"{name}-{meta['uid'][:8]}"
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        spec_dir = here / "spec"
        job_dir = here / "job"
        for path in (spec_dir, job_dir / "secrets", here / "home", here / "tmp"):
            path.mkdir(parents=True, exist_ok=True)

        def rewrite(text: str) -> str:
            return text.replace(POD_JOB_DIR, str(job_dir)).replace(POD_SPEC_DIR, str(spec_dir))

        self._secret_to(volumes["spec"]["secret"]["secretName"], spec_dir, rewrite)
        self._secret_to(volumes["secrets"]["secret"]["secretName"], job_dir / "secrets", rewrite)
        (container,) = spec["containers"]
        argv = [rewrite(a) for a in container["command"]]
        argv[0] = sys.executable if argv[0] == "python" else argv[0]
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONPATH": str(ROOT),
            "HOME": str(here / "home"),
            "TMPDIR": str(here / "tmp"),
            **{e["name"]: rewrite(str(e.get("value", ""))) for e in container.get("env") or []},
        }
        env["HOME"] = str(here / "home")
        log = (here / "container.log").open("wb")
        proc = subprocess.Popen(
            argv,
            cwd=job_dir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        oom = outcome if isinstance(outcome, OomKill) else None
        self._running[name] = _Running(
            name, meta["uid"], meta["namespace"], proc, grace, log=log, oom=oom
        )
        self._status(name, "Running", {"running": {"startedAt": _now()}})

    def _secret_to(self, secret: str, into: Path, rewrite: Any) -> None:
        obj = json_body(
            self.core.read_namespaced_secret(secret, self.namespace, _preload_content=False)
        )
        for key, value in (obj.get("data") or {}).items():
            path = into / key
            path.write_text(rewrite(base64.b64decode(value).decode()))
            path.chmod(0o400)

    def _report(self, run: _Running, ended: bool = False) -> None:
        if run.outcome is not None:
            if not ended and time.monotonic() - run.started < run.outcome.after_s:
                return
            code, reason = run.outcome.exit_code, run.outcome.reason
        else:
            assert run.proc is not None
            polled = run.proc.poll()
            if polled is None and ended:
                polled = run.proc.wait(timeout=10)
            if polled is None:
                if run.oom is not None and not run.oom_killed:
                    self._maybe_oom_kill(run)
                return
            code = polled if polled >= 0 else 128 - polled
            reason = "Completed" if code == 0 else "Error"
            if run.oom_killed:
                reason = "OOMKilled"
        self._running.pop(run.name, None)
        if run.log is not None:
            run.log.close()
        phase = "Succeeded" if code == 0 else "Failed"
        self._status(
            run.name,
            phase,
            {"terminated": {"exitCode": code, "reason": reason, "finishedAt": _now()}},
        )

    def _maybe_oom_kill(self, run: _Running) -> None:
        assert run.proc is not None and run.oom is not None
        if run.oom.when_output not in self.output(run.name):
            return
        children = psutil.Process(run.proc.pid).children(recursive=True)
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
        run.oom_killed = bool(children)

    def _terminate(self, run: _Running) -> None:
        """The pod was deleted: SIGTERM, then SIGKILL after its grace period."""
        self._running.pop(run.name, None)
        sent = self.signals.setdefault(run.name, [])
        if run.proc is None or run.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.proc.pid, signal.SIGTERM)
        sent.append("SIGTERM")
        try:
            run.proc.wait(timeout=run.grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.proc.pid, signal.SIGKILL)
            sent.append("SIGKILL")
            run.proc.wait(timeout=10)

    def _status(self, name: str, phase: str, state: dict[str, Any]) -> None:
        status = {
            "phase": phase,
            "containerStatuses": [
                {
                    "name": CONTAINER,
                    "image": "rhizome-learner",
                    "imageID": "",
                    "ready": phase == "Running",
                    "restartCount": 0,
                    "state": state,
                }
            ],
        }
        with contextlib.suppress(k8s.exceptions.ApiException):
            self.core.patch_namespaced_pod_status(name, self.namespace, {"status": status})


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
