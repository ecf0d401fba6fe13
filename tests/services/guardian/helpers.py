"""Shared by the lifecycle tests: jobs stored as the API would, guardians as the LCM would."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

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
    job_id: str, etcd_url: str, mongo_url: str, data_dir: Path, **env: str
) -> subprocess.Popen[bytes]:
    log = open(data_dir / f"guardian-{job_id}-{time.time_ns()}.log", "wb")  # noqa: SIM115
    return subprocess.Popen(
        guardian_argv(job_id, etcd_url, mongo_url, data_dir),
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
    lines = [f"job {job_id}: {record.status} ({record.status_message})", "history:"]
    lines += [f"  {h.status}: {h.message}" for h in record.history]
    learners = data_dir / "jobs" / job_id / "learners"
    logs = sorted(learners.glob("*/stderr.log")) + sorted(data_dir.glob(f"guardian-{job_id}-*"))
    for log in logs:
        text = log.read_text(errors="replace").splitlines()[-tail:]
        lines += [f"{log.relative_to(data_dir)} (last {len(text)} lines):"]
        lines += [f"  {line}" for line in text]
    return "\n".join(lines)


def history(repo: JobsRepository, job_id: str) -> list[str]:
    return [h.status for h in repo.get(job_id).history]
