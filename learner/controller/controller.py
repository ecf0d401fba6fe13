"""The learner controller: wraps the user command of one learner.

`python -m learner.controller --spec <job_dir>/learners/<rank>/spec.json`

Statuses, each recorded in etcd under `learners/<rank>/status` (with the history and
timestamps) while the controller holds a lease; the last one is written without the
lease, so it outlives the controller for the guardian to read:

- ``STARTING``     the controller claimed its rank (create-if-absent: one controller a rank);
- ``DOWNLOADING``  the code (the job's model zip, from its volume or object store, within
                   the archive limits: fetch.py) and data stores into the job directory;
- ``PROCESSING``   the user command runs, its stdout/stderr appended to
                   ``<job_dir>/learners/<rank>/stdout.log`` and ``stderr.log``, or, with
                   ``command_output: passthrough`` (a container), written to the
                   controller's own stdout/stderr — the container's streams, which the
                   platform's per-job collector ships (container_logs.py);
- ``STORING``      ``$RHIZOME_RESULT_DIR`` is copied to the job's result store;
- ``COMPLETED`` / ``FAILED`` (with the exit code) / ``HALTED`` (a halt was requested).

Restart safety: the phase and the command's (pid, start time) are kept in
``controller.json`` beside the logs, and the command runs in its own session under a tiny
shell wrapper that writes its exit code to a file. A controller restarted for the same
deploy generation re-adopts a command that still runs, or reads its exit code, instead
of running it twice; before starting a command it kills anything still labelled with its
job and rank, so there are never two learners of one rank.

Pipeline jobs (a `pipeline:` section, so `RHIZOME_PIPELINE_STAGES` in the learner's
environment): the command is the training script and this learner is one runtime worker,
worker = rank; the controller adds the worker's `RHIZOME_RUNTIME_*` variables
(`RuntimeEnv.for_learner`), and never starts a vanished worker again (KILLED instead):
the runtime has failed over without it (docs/runtime.md, "On the platform").

Fencing: every status is written only while this controller's lease still holds the key
(`EtcdClient.put_if_held`). A lease can lapse while the controller lives (its keep-alive
thread starved on a busy machine, etcd away longer than the TTL): etcd deletes the key and
the guardian starts a successor for the rank, which re-adopts the running command. When
the controller learns its lease is gone (the keep-alive's `on_lost`, or a fenced write),
it takes the rank again with a new lease if nobody has (create-if-absent); if a successor
has, it leaves at once (exit FATAL, "another live controller holds this rank") without
touching the command or writing anything: never two controllers acting for one rank.

Halt: the guardian writes ``{"action": "halt"}`` to the job's control key; the controller
sends SIGTERM to the command's process group (the checkpoint SDK saves on it), waits
``grace_s``, then SIGKILLs what is left (its HALTED status then says so, exit code 137,
for the guardian to put in the history). SIGTERM to the controller itself (the platform is
shutting down) does the same but records nothing, so a later guardian restarts the learner.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from contract import etcd_keys, procs
from contract.env import PIPELINE_STAGES, LearnerEnv, Role, RuntimeEnv, labels
from contract.etcd import EtcdClient, Lease
from contract.learner_spec import LearnerSpec
from contract.logs import COMMAND_STREAMS
from contract.status import ExitCode, LearnerStatus, status_value
from learner.controller.fetch import (
    CodeFetchError,
    ResultStoreError,
    fetch_code,
    storage_environ,
    upload_results,
)

log = logging.getLogger("learner.controller")

# The phases kept in controller.json are the statuses' values (restart safety reads them).
STARTING = LearnerStatus.STARTING
DOWNLOADING = LearnerStatus.DOWNLOADING
PROCESSING = LearnerStatus.PROCESSING
STORING = LearnerStatus.STORING
COMPLETED = LearnerStatus.COMPLETED
FAILED = LearnerStatus.FAILED
HALTED = LearnerStatus.HALTED

EXIT_OK = ExitCode.OK
EXIT_DUPLICATE = ExitCode.FATAL  # another live controller holds this rank
EXIT_TERMINATED = ExitCode.PREEMPTED
KILLED_EXIT_CODE = ExitCode.KILLED  # the command vanished without writing its exit code

# What a running learner costs its controller (issue #16): the command's exit wakes the
# controller at once (a thread blocked in waitid on it: no polling), so the liveness look
# while it runs is only a safety net; an adopted command (not our child: a restarted
# controller) is looked at every COMMAND_POLL_S as before.
COMMAND_POLL_S = 0.1
COMMAND_SAFETY_S = 2.0
# Orphans and the wrapper are reaped this often: nothing waits for a reap (exits are seen
# by waitid, liveness checks skip zombies), so it need not be the Reaper's 50 ms.
REAP_INTERVAL_S = 1.0

# The wrapper keeps the command's exit code on disk, so a restarted controller (not the
# command's parent any more) still learns it.
_WRAPPER = '/bin/sh -c "$1"; rc=$?; echo $rc > "$2.tmp" && mv "$2.tmp" "$2"; exit $rc'


class RankTaken(Exception):
    """Another controller holds this learner's rank: ours lapsed and a successor took it."""


def keep_streams_for_command(log_path: Path) -> tuple[int, int]:
    """Passthrough: keep this process's stdout and stderr (the container's streams) for
    the command, and send everything the controller itself writes (its log, a traceback)
    to `log_path` instead, so that the container's streams carry the command's output
    only. Returns the kept (stdout, stderr) descriptors."""
    sys.stdout.flush()
    sys.stderr.flush()
    kept = (os.dup(1), os.dup(2))
    for fd in kept:
        os.set_inheritable(fd, False)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    return kept


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, sort_keys=True))
    tmp.replace(path)


class Controller:
    def __init__(self, spec: LearnerSpec, etcd: EtcdClient) -> None:
        self.spec = spec
        self.etcd = etcd
        self.key = etcd_keys.learner_status(spec.job_id, spec.rank)
        self.lease: Lease | None = None
        # record() and a regain after a lapsed lease, one at a time (the regain runs in
        # the lease's keep-alive thread)
        self.holding = threading.Lock()
        self.fenced = threading.Event()  # a successor holds the rank: leave, touch nothing
        self.last: tuple[LearnerStatus, int | None, str] = (STARTING, None, "")
        self.history: list[list[Any]] = []
        self.halt = threading.Event()
        self.terminate = threading.Event()
        self.wake = threading.Event()
        self.reaper = procs.Reaper(interval_s=REAP_INTERVAL_S)
        self.children: set[int] = set()  # commands this controller started (exits wake it)
        self.state_path = spec.learner_dir / "controller.json"
        self.exit_path = spec.learner_dir / f"exit-{spec.generation}-{spec.restart}"
        self.state: dict[str, Any] = {}
        # Passthrough (`spec.passthrough`, a container): the descriptors the command writes
        # its stdout and stderr to, the container's own streams; `keep_streams_for_command`
        # sets them. None: the command inherits ours.
        self.command_fds: tuple[int, int] | None = None

    # -- etcd status --------------------------------------------------------------------
    def _value(self, status: LearnerStatus, exit_code: int | None, message: str) -> dict[str, Any]:
        return status_value(
            status,
            pid=os.getpid(),
            start=procs.start_ticks(os.getpid()),
            lease=self.lease.id if self.lease else 0,
            generation=self.spec.generation,
            restart=self.spec.restart,
            exit_code=exit_code,
            message=message,
            time=time.time(),
            history=self.history,
        )

    def record(
        self, status: LearnerStatus, exit_code: int | None = None, message: str = ""
    ) -> None:
        self.history.append([status.value, round(time.time(), 3)])
        with self.holding:
            for _ in range(2):  # the put, and once more after a regain
                lease = self.lease
                value = self._value(status, exit_code, message)
                held = lease is not None and self.etcd.put_if_held(
                    self.key, value, holder=lease, lease=None if status.final else lease
                )
                if held:
                    self.last = (status, exit_code, message)
                    break
                if not self._regain():
                    self.fenced.set()
                    raise RankTaken(
                        f"learner {self.spec.rank} of {self.spec.job_id}: another controller "
                        f"holds the rank (ours lapsed); not recording {status}"
                    )
        log.info("learner %s/%d: %s %s", self.spec.job_id, self.spec.rank, status, message)

    def _regain(self) -> bool:
        """After our lease lapsed (etcd deleted our key): take the rank again with a new
        lease, unless someone holds the key now. True when we hold it (again). Called
        with `holding` held."""
        current = self.etcd.get(self.key)
        if current is not None:
            return self.lease is not None and current.lease == self.lease.id
        fresh = self.etcd.grant(self.spec.lease_ttl_s).keep_alive(on_lost=self._lease_lost)
        status, exit_code, message = self.last
        previous, self.lease = self.lease, fresh
        if self.etcd.create(self.key, self._value(status, exit_code, message), lease=fresh):
            log.warning(
                "learner %s/%d: our lease lapsed; the rank is ours again with a new lease",
                self.spec.job_id,
                self.spec.rank,
            )
            if previous is not None:
                previous.revoke()
            return True
        self.lease = previous
        fresh.revoke()
        return False

    def _lease_lost(self) -> None:
        """The keep-alive found our lease expired: regain the rank, or leave it to the
        successor that has it (`fenced` wakes the main thread, which exits)."""
        with self.holding:
            if self.last[0].final:  # our last status outlives the lease: nothing to hold
                return
            try:
                if self._regain():
                    return
            except Exception:  # etcd away: the next write's fence decides
                log.warning(
                    "learner %s/%d: cannot regain the rank",
                    self.spec.job_id,
                    self.spec.rank,
                    exc_info=True,
                )
                return
            log.warning(
                "learner %s/%d: our lease lapsed and another controller holds the rank: "
                "leaving it the command",
                self.spec.job_id,
                self.spec.rank,
            )
            self.fenced.set()
            self.wake.set()

    def claim(self) -> bool:
        """Take the rank's status key; False if another live controller holds it."""
        deadline = time.monotonic() + self.spec.lease_ttl_s + 5
        while time.monotonic() < deadline:
            self.history = [[STARTING.value, round(time.time(), 3)]]
            if self.etcd.create(self.key, self._value(STARTING, None, ""), lease=self.lease):
                return True
            current = self.etcd.get(self.key)
            if current is None:
                continue
            value, lease = current.value, current.lease
            holder_alive = isinstance(value, dict) and procs.ref_alive(
                value.get("pid"), value.get("start")
            )
            if lease and holder_alive:
                return False
            if lease:
                self.etcd.revoke(lease)  # its holder is dead: free the rank now, not at TTL
            # A final status of an earlier incarnation waits for the guardian to clear it.
            time.sleep(0.1)
        return False

    # -- local state --------------------------------------------------------------------
    def load_state(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            state = json.loads(self.state_path.read_text())
            if state.get("incarnation") == self.spec.incarnation:
                self.state = state
                return
        self.state = {"incarnation": self.spec.incarnation, "phase": DOWNLOADING.value}
        with contextlib.suppress(FileNotFoundError):
            self.exit_path.unlink()
        self.save_state()

    def save_state(self) -> None:
        write_json(self.state_path, self.state)

    # -- phases -----------------------------------------------------------------------------
    def download(self) -> None:
        """The code (from the job's volume or object store; fetch.py), the data stores'
        links and the learner's directories. CodeFetchError leaves nothing behind."""
        fetch_code(self.spec)
        code = self.spec.code_dir
        code.mkdir(parents=True, exist_ok=True)
        data = Path(self.spec.job_dir) / "data"
        for store in self.spec.data_stores:
            source = (store.get("connection") or {}).get("path")
            if not source:
                continue
            data.mkdir(parents=True, exist_ok=True)
            link = data / str(store["id"])
            if not link.exists():
                with contextlib.suppress(FileExistsError):
                    link.symlink_to(Path(source).expanduser().resolve())
        self.spec.result_dir.mkdir(parents=True, exist_ok=True)
        self.spec.checkpoint_dir.mkdir(parents=True, exist_ok=True)

    def spawn(self) -> procs.ProcRef:
        # Fencing: whatever still runs for this rank (an earlier incarnation whose
        # controller died before it wrote the pid down) goes before a new command starts.
        procs.kill_labelled(self.spec.job_id, self.spec.rank, Role.LEARNER)
        learner_dir = self.spec.learner_dir
        env = dict(os.environ)
        # The object store's checkpoint URL and the job's credentials; an explicit
        # `env:` of the manifest (its own backup store) wins.
        env.update(storage_environ(self.spec))
        env.update(self.spec.env)
        env.update(self.runtime_environ())
        env.update(labels(self.spec.job_id, self.spec.rank, Role.LEARNER))
        argv = [
            "/bin/sh",
            "-c",
            _WRAPPER,
            "rhizome-learner",
            self.spec.command,
            str(self.exit_path),
        ]
        with contextlib.ExitStack() as files:
            out: IO[bytes] | int
            err: IO[bytes] | int
            if self.spec.passthrough:
                # Straight to the container's streams: the engine keeps each line with its
                # time, and the platform's collector ships them (no file, no copy by us).
                out, err = self.command_fds or (1, 2)
            else:
                out = files.enter_context(open(learner_dir / "stdout.log", "ab"))
                err = files.enter_context(open(learner_dir / "stderr.log", "ab"))
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                cwd=self.spec.code_dir,
                env=env,
                start_new_session=True,
            )
        ref = procs.ProcRef.of(proc.pid) or procs.ProcRef(proc.pid, -1)
        self.state.update(cmd_pid=ref.pid, cmd_start=ref.start)
        self.save_state()
        self.children.add(proc.pid)
        threading.Thread(
            target=self._wake_on_exit, args=(proc.pid,), name="command-exit", daemon=True
        ).start()
        return ref

    def _wake_on_exit(self, pid: int) -> None:
        """Block until our child `pid` has exited (WNOWAIT: the reaper still reaps it and
        keeps its status), then wake `wait_command`. Gone already (reaped): wake too."""
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        self.wake.set()

    @property
    def pipeline(self) -> bool:
        """A pipeline job's learner: its command is one worker of the runtime."""
        return bool(self.spec.env.get(PIPELINE_STAGES))

    def runtime_environ(self) -> dict[str, str]:
        """For a pipeline job (its `LearnerEnv` has `pipeline_stages`), the runtime worker's
        `RHIZOME_RUNTIME_*` variables: this learner is worker `rank` (docs/runtime.md)."""
        runtime = RuntimeEnv.for_learner(LearnerEnv.from_environ(self.spec.env), self.spec.etcd_url)
        return {} if runtime is None else runtime.to_environ()

    def command_exit_code(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int(self.exit_path.read_text().strip())
        return None

    def wait_command(self, ref: procs.ProcRef) -> int | None:
        """Wait until the command ends (exit code) or a halt/terminate comes (None)."""
        while True:
            if self.halt.is_set() or self.terminate.is_set() or self.fenced.is_set():
                return None
            # Cheap while the wrapper lives (one /proc read); the group scan only after.
            wrapper_alive = ref.alive()
            if not wrapper_alive and not procs.group_alive(ref.pid):
                code = self.command_exit_code()
                return code if code is not None else KILLED_EXIT_CODE
            # Our child's exit wakes us (`_wake_on_exit`); after it, what is left of its
            # group, or a command we adopted, is looked at every COMMAND_POLL_S.
            woken = wrapper_alive and ref.pid in self.children
            self.wake.wait(COMMAND_SAFETY_S if woken else COMMAND_POLL_S)
            self.wake.clear()

    def stop_command(self, ref: procs.ProcRef) -> bool:
        """SIGTERM, ``grace_s`` to save and leave, then SIGKILL. True when the command
        was still running once the grace was over (it was killed: the grace is bounded,
        a script that ignores SIGTERM does not hold a halt up)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(ref.pid, signal.SIGTERM)
        # and what carries the learner's label outside the group (it forked away)
        for pid in procs.labelled(self.spec.job_id, self.spec.rank, Role.LEARNER):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.spec.grace_s
        while procs.group_alive(ref.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        killed = procs.group_alive(ref.pid)
        # the labelled processes left get the rest of the grace, then SIGKILL
        left = 0.0 if killed else max(0.0, deadline - time.monotonic())
        procs.kill_labelled(self.spec.job_id, self.spec.rank, Role.LEARNER, grace_s=left)
        return killed

    def store_results(self) -> None:
        """Copy the learner's results to the job's result store, and to each data store
        that names a `training_results` container (FfDL's results location)."""
        source = self.spec.result_dir
        if not source.exists() or not any(source.iterdir()):
            return
        access = self.spec.storage_access
        if access is not None:
            upload_results(access, self.spec.rank, source)
            return
        targets = [Path(self.spec.result_store)] if self.spec.result_store else []
        targets += [Path(s["results_path"]) for s in self.spec.data_stores if s.get("results_path")]
        for target in targets:
            shutil.copytree(source, target, dirs_exist_ok=True)

    def _control_changed(self) -> None:
        with contextlib.suppress(Exception):
            current = self.etcd.get(etcd_keys.control(self.spec.job_id))
            if (
                current
                and isinstance(current.value, dict)
                and current.value.get("action") in ("halt", "delete")
            ):
                self.halt.set()
                self.wake.set()

    def _start_collector(self) -> Any:
        if not self.spec.tds_address:
            return None
        try:
            from learner.controller.collector import SOURCES_ALL, SOURCES_FILES, Collector
        except ImportError:
            return None
        streams: tuple[str, ...] = COMMAND_STREAMS
        kinds = SOURCES_ALL
        if self.spec.passthrough:
            # The platform ships the container's streams (and the metrics read from them);
            # here only the metric sources that read files of the job directory.
            streams, kinds = (), SOURCES_FILES
        try:
            collector = Collector(
                self.spec.job_id,
                self.spec.rank,
                self.spec.job_dir,
                self.spec.tds_address,
                metric_sources=self.spec.metric_sources,
                token=self.spec.tds_token,
                tls=self.spec.tds_tls,
                streams=streams,
                source_kinds=kinds,
            )
            if not streams and not collector.sources:
                collector.stop(drain=False)
                return None
            collector.start()
            return collector
        except Exception:  # logs still land in the files; only streaming is lost
            log.exception("cannot start the log collector")
            return None

    def fail_download(self, why: str) -> int:
        """The code cannot be had: FAILED with the reason, also in the learner's stderr
        (the guardian puts its last lines in the job's record)."""
        message = f"cannot fetch the job's code: {why}"
        self.command_stderr(f"rhizome: {message}\n")
        self.state.update(phase=FAILED, exit_code=ExitCode.FAILED)
        self.save_state()
        self.record(FAILED, exit_code=int(ExitCode.FAILED), message=message)
        return EXIT_OK

    def command_stderr(self, text: str) -> None:
        """A line in the command's stderr (the guardian puts its last lines in the job's
        record): the file, or the container's stderr in passthrough."""
        with contextlib.suppress(OSError):
            if self.spec.passthrough:
                os.write(self.command_fds[1] if self.command_fds else 2, text.encode())
                return
            with open(self.spec.learner_dir / "stderr.log", "a") as err:
                err.write(text)

    # -- the whole life ---------------------------------------------------------------------
    def run(self) -> int:
        self.spec.learner_dir.mkdir(parents=True, exist_ok=True)
        procs.become_subreaper()
        self.reaper.start()
        lease = self.etcd.grant(self.spec.lease_ttl_s)
        self.lease = lease.keep_alive(on_lost=self._lease_lost)
        if not self.claim():
            log.warning(
                "rank %d of %s is held by another controller", self.spec.rank, self.spec.job_id
            )
            lease.revoke()
            return EXIT_DUPLICATE
        cancel = self.etcd.watch(etcd_keys.control(self.spec.job_id), self._control_changed)
        self._control_changed()
        try:
            return self._lifecycle()
        except RankTaken as exc:
            log.warning("%s; exiting", exc)
            return EXIT_DUPLICATE
        finally:
            cancel()
            with self.holding:
                if self.lease is not None:
                    self.lease.revoke()
            self.reaper.stop()

    def _lifecycle(self) -> int:
        self.load_state()
        if self.state["phase"] == DOWNLOADING:
            self.record(DOWNLOADING)
            try:
                self.download()
            except CodeFetchError as exc:
                return self.fail_download(str(exc))
            except Exception as exc:  # a bug or a broken image: fail saying so, no restart loop
                log.exception("fetching the code failed")
                return self.fail_download(f"{type(exc).__name__}: {exc}")
            self.state["phase"] = PROCESSING
            self.save_state()
        if self.halt.is_set():
            self.record(HALTED, message="halted before the command started")
            return EXIT_OK
        code: int | None
        if self.state["phase"] == PROCESSING:
            self.record(PROCESSING)
            ref = procs.ProcRef(
                int(self.state.get("cmd_pid", 0)), int(self.state.get("cmd_start", -1))
            )
            code = self.command_exit_code()
            if code is None and not ref.alive():
                if self.pipeline and self.state.get("cmd_pid"):
                    # A pipeline worker that vanished with its controller is not started
                    # again: its peers have failed over without it, and a worker cannot
                    # rejoin a running job before reconfiguration (issue #16).
                    code = KILLED_EXIT_CODE
                else:
                    ref = self.spawn()
            collector = self._start_collector()
            if code is None:
                code = self.wait_command(ref)
            if code is None and self.fenced.is_set():
                # A successor holds the rank and has adopted the command: not ours to stop.
                if collector is not None:
                    collector.stop(drain=False)
                raise RankTaken(
                    f"learner {self.spec.rank} of {self.spec.job_id}: a successor holds the "
                    "rank and has the command"
                )
            if code is None:
                killed = self.stop_command(ref)
                if collector is not None:
                    collector.stop(drain=True)
                if self.terminate.is_set() and not self.halt.is_set():
                    return EXIT_TERMINATED  # the lease goes with us: the guardian restarts us
                if killed:  # the exit code says so to the guardian, which tells the user
                    self.record(
                        HALTED,
                        exit_code=int(KILLED_EXIT_CODE),
                        message=f"halted on request; the command did not stop within its "
                        f"{self.spec.grace_s:g} s grace after SIGTERM and was killed",
                    )
                    return EXIT_OK
                self.record(HALTED, message="halted on request")
                return EXIT_OK
            if collector is not None:
                collector.stop(drain=True)
            self.state.update(phase=STORING if code == 0 else FAILED, exit_code=code)
            self.save_state()
        code = int(self.state.get("exit_code", 0))
        if self.state["phase"] == STORING:
            self.record(STORING)
            try:
                self.store_results()
            except ResultStoreError as exc:
                self.state.update(phase=FAILED, exit_code=ExitCode.FAILED)
                self.save_state()
                self.record(FAILED, exit_code=int(ExitCode.FAILED), message=str(exc))
                return EXIT_OK
            self.state["phase"] = COMPLETED
            self.save_state()
        if self.state["phase"] == COMPLETED:
            self.record(COMPLETED, exit_code=0)
            return EXIT_OK
        self.record(FAILED, exit_code=code, message=f"the command exited with code {code}")
        return EXIT_OK
