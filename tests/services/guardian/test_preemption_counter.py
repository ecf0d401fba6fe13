"""Spot preemptions have their own counter: a learner whose command ends by SIGTERM or
SIGKILL (its node's notice, the injector) is restarted without counting against
`max_learner_restarts`, up to `max_preemptions`; the history says what ended it. Real
etcd and MongoDB-wire server, the local backend, a guardian process, and the preemption
injector as users run it (`rhizome inject --job`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.injector.targets import JobTargets
from services.store import states
from tests.services.guardian.helpers import job_report, start_guardian, submit, wait_for

pytestmark = pytest.mark.integration

# Runs until the test creates <job dir>/stop; dies of the injector's SIGTERM, or of its
# SIGKILL after the notice (the shell and its wrapper decide which ends it first).
SCRIPT = "while [ ! -e ../stop ]; do sleep 0.1; done\n"


def preempted(stores: dict[str, Any], job_id: str) -> list[str]:
    return [h.message for h in stores["repo"].get(job_id).history if "preempted" in h.message]


def inject_one(stores: dict[str, Any], job_id: str, seed: int) -> dict[str, Any]:
    """One preemption by `rhizome inject --job`, once the learner runs its command again.

    The injector preempts whoever runs when its schedule fires and records a "missed"
    preemption when nobody does (a trace replay goes on): injected while the guardian was
    still restarting the learner, this test's preemption would be one that never happened.
    So it waits for a target as the injector sees one (`JobTargets`: status PROCESSING and
    the command's processes found by their labels) and checks that one was preempted."""
    wait_for("a learner to preempt", lambda: JobTargets(stores["etcd"], job_id).current())
    inject = subprocess.run(
        [sys.executable, "-m", "services.client.cli", "inject", "--job", job_id,
         "--etcd", stores["etcd_url"], "--mttp", "0.5", "--count", "1",
         "--notice", "1", "--seed", str(seed), "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert inject.returncode == 0, inject.stderr
    done = json.loads(inject.stdout)
    assert len(done) == 1 and done[0]["outcome"] in ("exited", "killed"), inject.stdout
    return dict(done[0])


def test_a_job_with_one_allowed_restart_survives_three_injected_preemptions(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    repo = stores["repo"]
    job = submit(repo, tmp_path, "sh run.sh", files={"run.sh": SCRIPT}, max_learner_restarts=1)
    guardian = start_guardian(job.job_id, stores["etcd_url"], stores["mongo_url"], tmp_path)
    injected: list[dict[str, Any]] = []

    def why() -> str:
        return f"{job_report(repo, job.job_id, tmp_path)}\ninjector said: {injected}"

    try:
        wait_for("PROCESSING", lambda: repo.get(job.job_id).status == states.PROCESSING)
        for n in range(1, 4):
            # one preemption at a time, each of a learner that runs its command
            injected.append(inject_one(stores, job.job_id, seed=n))

            def counted(n: int = n) -> bool:
                return len(preempted(stores, job.job_id)) >= n

            wait_for(f"preemption {n} in the history", counted, explain=why)
        record = repo.get(job.job_id)
        assert record.status == states.PROCESSING, record.status_message
        notes = preempted(stores, job.job_id)
        assert len(notes) == 3, notes
        for n, note in enumerate(notes, 1):
            assert re.match(r"learner 0 preempted \(exit (143, SIGTERM|137, SIGKILL)", note), note
            assert (
                f"preemption {n} of at most 100 (not counted against max_learner_restarts)" in note
            )
        (tmp_path / "jobs" / job.job_id / "stop").touch()
        wait_for("COMPLETED", lambda: repo.get(job.job_id).status == states.COMPLETED)
        assert guardian.wait(timeout=30) == 0
    finally:
        (tmp_path / "jobs" / job.job_id / "stop").touch()  # a failed run leaves no learner
        if guardian.poll() is None:
            guardian.kill()
            guardian.wait()


def test_a_failure_of_the_users_code_still_counts_against_max_learner_restarts(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    repo = stores["repo"]
    job = submit(repo, tmp_path, "sh run.sh", files={"run.sh": "exit 7\n"}, max_learner_restarts=1)
    guardian = start_guardian(job.job_id, stores["etcd_url"], stores["mongo_url"], tmp_path)
    try:
        assert guardian.wait(timeout=90) == 0
        record = repo.get(job.job_id)
        assert record.status == states.FAILED
        assert record.status_message.startswith("learner 0 exited with code 7 after 1 restarts")
        assert preempted(stores, job.job_id) == []
    finally:
        if guardian.poll() is None:
            guardian.kill()
            guardian.wait()


def test_past_max_preemptions_the_job_fails_saying_so(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    repo = stores["repo"]
    job = submit(repo, tmp_path, "sh run.sh", files={"run.sh": SCRIPT}, max_preemptions=0)
    guardian = start_guardian(job.job_id, stores["etcd_url"], stores["mongo_url"], tmp_path)
    try:
        wait_for("PROCESSING", lambda: repo.get(job.job_id).status == states.PROCESSING)
        inject_one(stores, job.job_id, seed=0)
        assert guardian.wait(timeout=60) == 0
        record = repo.get(job.job_id)
        assert record.status == states.FAILED
        assert re.match(
            r"learner 0 exited with code (143|137) \(preempted 1 times; max_preemptions 0\)",
            record.status_message,
        ), record.status_message
    finally:
        (tmp_path / "jobs" / job.job_id / "stop").touch()  # a failed run leaves no learner
        if guardian.poll() is None:
            guardian.kill()
            guardian.wait()


def test_a_kill_for_memory_counts_as_the_jobs_own_failure_not_a_preemption(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    # The kernel's OOM kill exits 137, as a preemption's SIGKILL does; the backend tells
    # them apart (the learner's memory cgroup counted an oom_kill), so a job with no
    # restarts left fails at once instead of being restarted as preempted.
    hog = "x = bytearray(512 * 1024 * 1024)\nprint(len(x))\n"
    repo = stores["repo"]
    job = submit(
        repo,
        tmp_path,
        "python hog.py",
        files={"hog.py": hog},
        max_learner_restarts=0,
        memory="96MiB",
    )
    guardian = start_guardian(job.job_id, stores["etcd_url"], stores["mongo_url"], tmp_path)
    try:
        assert guardian.wait(timeout=120) == 0
        record = repo.get(job.job_id)
        assert record.status == states.FAILED, record.status_message
        assert record.status_message.startswith("learner 0 exited with code 137"), (
            record.status_message
        )
        assert preempted(stores, job.job_id) == []
    finally:
        if guardian.poll() is None:
            guardian.kill()
            guardian.wait()
