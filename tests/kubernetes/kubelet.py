"""A kubelet EMULATOR for the daemon-level tests (test code, never the product).

The API emulator (kmock) has no kubelets, so a pod bound to a node never runs. This plays
every node's kubelet from one thread of the test process:

- a pod bound to a node (`spec.nodeName`) gets a directory of its own standing in for
  its volumes: the job emptyDir, and every Secret volume (the learner spec, the job's
  data-store credentials, its TDS certificate) projected as a kubelet projects one, the
  pod's paths in the spec and the environment rewritten to that directory;
- a Secret volume is projected as the kubelet's atomic writer does it: the files go into
  a new hidden directory `..<timestamp>`, the symlink `..data` is swapped to it with a
  rename, and each key is a symlink `KEY -> ..data/KEY`; while the pod runs, the
  emulator re-reads its Secrets every `secret_sync_s` and projects a changed one again
  the same way (a real kubelet does it on its sync period, about a minute; a `subPath`
  mount would never be refreshed, so the backend mounts directories);
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
import itertools
import os
import shutil
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

# The default mode of a Secret volume's files when the pod names none (the API's default).
DEFAULT_SECRET_MODE = 0o644

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
class SecretVolume:
    """One Secret volume of a running pod, projected into `into` (its mount, here)."""

    name: str  # the pod's name for the volume
    secret: str
    into: Path
    mode: int
    rewrite: Any
    data: dict[str, str] | None = None  # what was projected last (the Secret's data)
    projections: int = 0  # how many times it was projected (1: never refreshed)


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
    volumes: list[SecretVolume] = field(default_factory=list)


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
        # How often a running pod's Secret volumes are re-read and, when changed, projected
        # again (a real kubelet: its sync period plus its cache's TTL, about a minute).
        self.secret_sync_s = 0.5
        self._synced = 0.0
        self._stamps = itertools.count()
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
                # a container's end takes every process in it, as its cgroup does: the
                # controller runs the command in a process group of its own, which a
                # SIGKILL of the controller's group alone would leave running
                descendants: list[psutil.Process] = []
                with contextlib.suppress(psutil.Error):
                    descendants = psutil.Process(run.proc.pid).children(recursive=True)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.proc.pid, signal.SIGKILL)
                for child in descendants:
                    with contextlib.suppress(psutil.Error):
                        child.kill()
                run.proc.wait(timeout=10)

    def process(self, pod: str) -> subprocess.Popen[bytes] | None:
        """The running pod's container process (None: not running here, or scripted)."""
        run = self._running.get(pod)
        return run.proc if run is not None else None

    def secret_volume(self, pod: str, volume: str) -> SecretVolume:
        """The running pod's Secret volume of that name, as last projected."""
        (found,) = [v for v in self._running[pod].volumes if v.name == volume]
        return found

    def output(self, pod: str) -> str:
        """What the pod's container wrote: the controller's own output, then the user
        command's stdout (in the job emptyDir, `learners/<rank>/stdout.log`)."""
        out = []
        for here in sorted(self.root.glob(f"{pod}-*")):
            logs = sorted((here / "job" / "learners").glob("*/stdout.log"))
            # A pod being started has its directory before its container's log.
            files = [p for p in [here / "container.log", *logs] if p.exists()]
            out += [p.read_text(errors="replace") for p in files]
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
        if time.monotonic() - self._synced >= self.secret_sync_s:
            self._synced = time.monotonic()
            for run in list(self._running.values()):
                for vol in run.volumes:
                    with contextlib.suppress(k8s.exceptions.ApiException):
                        self._project(vol)  # a Secret gone: the kubelet keeps the last files
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
        (container,) = spec["containers"]
        spec_dir = here / "spec"
        job_dir = here / "job"
        for made in (spec_dir, job_dir, here / "home", here / "tmp"):
            made.mkdir(parents=True, exist_ok=True)
        # The pod's paths, as this node has them: the job emptyDir and the spec Secret
        # where they always were here, any other Secret volume under `volumes/<name>`
        # (one inside the job directory stays there).
        places = {POD_JOB_DIR: job_dir, POD_SPEC_DIR: spec_dir}
        secrets: list[tuple[str, dict[str, Any], Path]] = []  # (volume, its source, where)
        for mount in container.get("volumeMounts") or []:
            assert "subPath" not in mount, "a subPath mount is never refreshed by a kubelet"
            source = volumes[mount["name"]]
            if "secret" not in source:
                continue
            mounted = str(mount["mountPath"])
            if mounted in places:
                into = places[mounted]
            elif mounted.startswith(POD_JOB_DIR + "/"):
                into = job_dir / mounted[len(POD_JOB_DIR) + 1 :]
            else:
                into = places[mounted] = here / "volumes" / mount["name"]
            secrets.append((mount["name"], source["secret"], into))
        order = sorted(places, key=len, reverse=True)  # the longest path first

        def rewrite(text: str) -> str:
            for pod_path in order:
                text = text.replace(pod_path, str(places[pod_path]))
            return text

        projected = [
            SecretVolume(
                volume,
                str(secret["secretName"]),
                into,
                int(secret.get("defaultMode", DEFAULT_SECRET_MODE)),
                rewrite,
            )
            for volume, secret, into in secrets
        ]
        for vol in projected:
            self._project(vol)
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
            name, meta["uid"], meta["namespace"], proc, grace, log=log, oom=oom, volumes=projected
        )
        self._status(name, "Running", {"running": {"startedAt": _now()}})

    def _project(self, vol: SecretVolume) -> None:
        """Project the Secret into its volume if it changed since the last projection, as
        the kubelet's atomic writer does: a new `..<stamp>` directory, `..data` swapped to
        it by a rename, each key a link through `..data`; the old directory removed."""
        obj = json_body(
            self.core.read_namespaced_secret(vol.secret, self.namespace, _preload_content=False)
        )
        data = {str(k): str(v) for k, v in (obj.get("data") or {}).items()}
        if data == vol.data:
            return
        vol.into.mkdir(parents=True, exist_ok=True)
        stamp = vol.into / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{next(self._stamps)}"
        stamp.mkdir(mode=0o755)
        for key, value in data.items():
            path = stamp / key
            path.write_text(vol.rewrite(base64.b64decode(value).decode()))
            path.chmod(vol.mode)
        link = vol.into / "..data"
        old = os.readlink(link) if link.is_symlink() else None
        tmp = vol.into / "..data_tmp"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        tmp.symlink_to(stamp.name)
        os.replace(tmp, link)  # the swap: a reader sees the old files or the new, whole
        for key in data:
            if not (vol.into / key).is_symlink():
                (vol.into / key).symlink_to(f"..data/{key}")
        for key in set(vol.data or {}) - set(data):
            with contextlib.suppress(FileNotFoundError):
                (vol.into / key).unlink()
        if old is not None:
            shutil.rmtree(vol.into / old, ignore_errors=True)
        vol.data = data
        vol.projections += 1

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
