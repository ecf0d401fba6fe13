"""Shared by the lifecycle tests: jobs stored as the API would, guardians as the LCM would."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from queue import Queue
from typing import Any, TypeVar

from contract import etcd_keys
from contract.learner_spec import DEFAULT_LEARNER_LEASE_TTL_S
from services.backends.api import Backend
from services.guardian.config import GuardianConfig
from services.guardian.host import HOST_SAFETY_POLL_S, GuardianHost, HostConfig
from services.manifest import parse_manifest
from services.store import states
from services.store.jobs import JobRecord, JobsRepository, new_job_id
from services.store.objects import LocalObjectStore

T = TypeVar("T")


def code_zip(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return buf.getvalue()


def submit(
    repo: JobsRepository,
    data_dir: Path,
    command: str,
    learners: int = 1,
    files: dict[str, str] | None = None,
    place: bool = True,
    **extra: Any,
) -> JobRecord:
    """Store a job as the API does (code first, then a QUEUED record); with `place`,
    move it to PENDING with a local placement as the scheduler would."""
    manifest: dict[str, Any] = {
        "name": "test",
        "learners": learners,
        "memory": "512MiB",
        "framework": {"command": command},
        **extra,
    }
    parsed = parse_manifest(json.dumps(manifest))
    job_id = new_job_id()
    model_path = f"models/{job_id}.zip"
    LocalObjectStore(data_dir / "objects").put(model_path, code_zip(files or {"run.sh": "true\n"}))
    record = JobRecord.for_manifest(job_id, "tester", parsed, model_path=model_path)
    repo.create(record)
    if place:
        repo.transition(
            job_id,
            states.PENDING,
            "placed",
            placement={"learner_nodes": {str(r): "local" for r in range(learners)}, "placed_at": 0},
        )
    return repo.get(job_id)


def guardian_argv(job_id: str, etcd_url: str, mongo_url: str, data_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "services.guardian",
        f"--job-id={job_id}",
        f"--etcd={etcd_url}",
        f"--mongodb-uri={mongo_url}",
        f"--data-dir={data_dir}",
    ]


def start_guardian(
    job_id: str,
    etcd_url: str,
    mongo_url: str,
    data_dir: Path,
    args: Sequence[str] = (),
    **env: str,
) -> subprocess.Popen[bytes]:
    """A guardian process as the LCM starts it (`args`: more of its command line); its
    output in `guardian-<job>-<ns>.log` under `data_dir` (`job_report` prints its tail)."""
    log = open(data_dir / f"guardian-{job_id}-{time.time_ns()}.log", "wb")  # noqa: SIM115
    return subprocess.Popen(
        [*guardian_argv(job_id, etcd_url, mongo_url, data_dir), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
        start_new_session=True,
    )


def wait_for(
    what: str,
    probe: Callable[[], T | None],
    timeout_s: float = 60.0,
    explain: Callable[[], str] | None = None,
) -> T:
    """``probe()`` until it is truthy; on time-out the failure says what was awaited and,
    with ``explain``, what the job looked like then (a CI failure must explain itself)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    detail = f"\n{explain()}" if explain is not None else ""
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}{detail}")


def job_report(repo: JobsRepository, job_id: str, data_dir: Path, tail: int = 15) -> str:
    """The job's status and history, and the last lines of each learner's stderr and of
    its guardian's log: what a failed wait prints."""
    record = repo.get(job_id)
    return describe_job(
        job_id,
        record.status,
        record.status_message,
        [(h.status, h.message) for h in record.history],
        data_dir,
        tail,
    )


def describe_job(
    job_id: str,
    status: str,
    message: str,
    entries: Sequence[tuple[str, str]],
    data_dir: Path,
    tail: int = 15,
) -> str:
    """`job_report` from what was read of the job (the record, or `rhizome show --json`
    where the test has a whole platform): status, history (status, message) and the last
    lines of each learner's stderr and of the guardian's log under `data_dir`."""
    lines = [f"job {job_id}: {status} ({message})", "history:"]
    lines += [f"  {st}: {m}" for st, m in entries]
    learners = data_dir / "jobs" / job_id / "learners"
    logs = sorted(learners.glob("*/stderr.log")) + sorted(data_dir.glob(f"guardian-{job_id}-*"))
    for log in logs:
        text = log.read_text(errors="replace").splitlines()[-tail:]
        lines += [f"{log.relative_to(data_dir)} (last {len(text)} lines):"]
        lines += [f"  {line}" for line in text]
    return "\n".join(lines)


@contextmanager
def running_host(
    stores: dict[str, Any],
    tmp_path: Path,
    backend: Backend,
    *,
    poll_s: float,
    safety_poll_s: float = HOST_SAFETY_POLL_S,
    host_id: str = "test",
    host_type: type[GuardianHost] = GuardianHost,
    learner_lease_ttl_s: int = DEFAULT_LEARNER_LEASE_TTL_S,
    **kwargs: Any,
) -> Iterator[tuple[GuardianHost, list[int]]]:
    """A guardian host in this process, its loop running in a thread, its input open (as
    an LCM's pipe; the tests give jobs by `host.adopt`); the list gets the loop's exit
    code. Its timers: a guardian steps every `poll_s` without a change while something
    is counted in time, every `safety_poll_s` once settled; its learners' leases last
    `learner_lease_ttl_s` (a controller's death seen only by its lease's expiry is seen
    that late). `kwargs` go to the host
    (`reaper=`). However the test ends, every job the host still guards is deleted (its
    learners stopped) before its input closes: a job left running would keep the loop,
    and so pytest's exit, waiting for it; guardians that a delete does not end (stubs)
    are detached, as on SIGTERM. A test may end the host itself first
    (`host.terminate`)."""
    lines: Queue[str | None] = Queue()

    def make_config(job_id: str, env: dict[str, str]) -> GuardianConfig:
        return GuardianConfig(
            job_id,
            stores["etcd_url"],
            stores["mongo_url"],
            tmp_path,
            learner_grace_s=1.0,
            learner_lease_ttl_s=learner_lease_ttl_s,
        )

    host = host_type(
        HostConfig(host_id, poll_s=poll_s, safety_poll_s=safety_poll_s),
        stores["etcd"],
        stores["repo"],
        backend,
        make_config,
        **kwargs,
    ).start()
    ended: list[int] = []
    runs = threading.Thread(
        target=lambda: ended.append(host.run(iter(lines.get, None))), daemon=True
    )
    runs.start()
    try:
        yield host, ended
    finally:
        if not host.terminate.is_set():
            for job_id in list(host.guardians):
                stores["etcd"].put(
                    etcd_keys.control(job_id), {"action": "delete", "reason": "test"}
                )
            deadline = time.monotonic() + 30
            while host.guardians and time.monotonic() < deadline:
                time.sleep(0.1)
            if host.guardians:
                host.terminate.set()
                host.changed.set()
        lines.put(None)
        runs.join(60)
        host.close()


def history(repo: JobsRepository, job_id: str) -> list[str]:
    return [h.status for h in repo.get(job_id).history]


# The pipeline guardian tests' training script: the runtime's float64 toy
# (learner/runtime/toy.py: --steps, --gate, --die, --die-replacement).
TOY_SCRIPT = "from learner.runtime.toy import main\n\nmain()\n"


@dataclass
class PipelineRun:
    """A pipeline job of the toy under its guardian process (`pipeline_job`)."""

    repo: JobsRepository
    job: JobRecord
    data_dir: Path
    guardian: subprocess.Popen[bytes]

    @property
    def learners_dir(self) -> Path:
        return self.data_dir / "jobs" / self.job.job_id / "learners"

    def explain(self) -> str:
        return job_report(self.repo, self.job.job_id, self.data_dir)

    def logged(self, rank: int, text: str, stream: str = "stderr.log") -> bool:
        """Whether learner `rank`'s `stream` (any incarnation's) holds `text`."""
        log = self.learners_dir / str(rank) / stream
        return log.exists() and text in log.read_text(errors="replace")

    def wait(self, what: str, probe: Callable[[], T | None], timeout_s: float = 240) -> T:
        """`wait_for` that prints the job's history and logs on time-out."""
        return wait_for(what, probe, timeout_s, self.explain)

    def formed(self, ranks: Sequence[int] = (0, 1)) -> None:
        """Wait until every worker in `ranks` started its stage: the pipeline formed, so
        a loss from now on is the runtime's failover (before, a lost worker restarts in
        place: PipelineFailover.restart_unformed)."""
        self.wait(
            "the pipeline formed",
            lambda: all(self.logged(r, f"[worker {r}] started:") for r in ranks),
        )

    def notes(self) -> list[str]:
        return [h.message for h in self.repo.get(self.job.job_id).history]

    def end(self, timeout_s: float = 400) -> JobRecord:
        """The job's terminal record, once its guardian exited cleanly."""

        def ended() -> JobRecord | None:
            record = self.repo.get(self.job.job_id)
            return record if record.status in states.TERMINAL_STATES else None

        record = self.wait("the job's end", ended, timeout_s)
        assert self.guardian.wait(timeout=60) == 0, self.explain()
        return record


@contextmanager
def pipeline_job(
    stores: dict[str, Any],
    data_dir: Path,
    command: str,
    *,
    pipeline: dict[str, Any] | None = None,
    max_learner_restarts: int = 2,
    place: Callable[[JobRecord], None] | None = None,
    guardian_args: Sequence[str] = (),
    guardian_env: Callable[[JobRecord], dict[str, str]] | None = None,
) -> Iterator[PipelineRun]:
    """Submit a pipeline job of the toy (`train.py`; `pipeline` defaults to two stages,
    one pipeline) and start its guardian; the guardian is killed on the way out if it is
    still running. `place`: the test places the job itself (else a local placement);
    `guardian_args`, `guardian_env` (given the job): as the LCM would start the guardian."""
    repo: JobsRepository = stores["repo"]
    pipe = pipeline or {"stages": 2, "pipelines": 1}
    job = submit(
        repo,
        data_dir,
        command,
        learners=int(pipe["stages"]) * int(pipe.get("pipelines", 1)),
        files={"train.py": TOY_SCRIPT},
        place=place is None,
        pipeline=pipe,
        max_learner_restarts=max_learner_restarts,
    )
    if place is not None:
        place(job)
    guardian = start_guardian(
        job.job_id,
        stores["etcd_url"],
        stores["mongo_url"],
        data_dir,
        guardian_args,
        **(guardian_env(job) if guardian_env is not None else {}),
    )
    try:
        yield PipelineRun(repo, job, data_dir, guardian)
    finally:
        if guardian.poll() is None:
            guardian.kill()
            guardian.wait()
