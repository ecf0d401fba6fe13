"""Save before preempt, end to end (issue #19), on the real platform: a daemon (API,
scheduler, LCM; guardians and learner controllers as processes on the local backend)
over the real etcd and MongoDB-wire servers, with a quota config.

A borrower's job that checkpoints through the SDK (learner.sdk, no torch) holds the only
2 FAKE GPUs; the quota owner's job needs them. The scheduler halts the borrower
(services/scheduler/hosting.py `_halt` → LCM HaltJob → the learner gets SIGTERM with the
manifest's grace → the SDK's emergency save) and:
- the borrower's history says who preempted it and why;
- an emergency checkpoint was committed after the preemption was decided, at the last
  step the script finished (beyond its last periodic save: nothing since was lost);
- the preemption counted against nothing (`max_learner_restarts: 0`, attempts);
- resumed once the owner's job ended, it continues from the emergency checkpoint's step.

And the grace is bounded: a script that ignores SIGTERM is killed once its grace is over,
and the history says so."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from rhizome.v1 import job_pb2

from contract import procs
from services.client.sdk import Client
from services.daemon import Daemon
from services.embedded.process import ManagedServer
from tests.daemons import running_daemon
from tests.integration.conftest import token_client
from tests.services.guardian.helpers import code_zip, wait_for

pytestmark = pytest.mark.integration

T = TypeVar("T")

CLUSTER = """nodes:
  - name: gpu-0
    cpus: 4
    memory_mb: 4096
    gpus: 2
    gpu_type: FAKE
"""
# the owner's quota is the whole cluster; everyone else borrows
QUOTAS = """borrowing: true
default: {quota: {}, limit: {FAKE: 2}}
users:
  owner: {quota: {FAKE: 2}, limit: {FAKE: 2}}
"""
GRACE_S = 3
# A tiny training loop on the checkpoint SDK: the "model" is a number updated each step;
# it saves every SAVE_EVERY steps on its own (periodic) and when the SDK says so (an
# emergency save after SIGTERM, then the SDK exits 143). Each finished step is a line
# on stdout. Steps take 0.05 s until the test opens the gate (GATE: a path it fills in)
# once the first run was preempted: the resumed run then needs no pace (it took ~10 s).
TRAIN = """import json, os, sys, time
import learner.sdk as rz

steps, every = int(sys.argv[1]), int(sys.argv[2])
start, w = 0, 0.0
ckpt = rz.latest_checkpoint()
if ckpt is not None:
    state = json.loads(open(ckpt.path).read())
    start, w = int(state["step"]), float(state["w"])
print(f"start from {start}", flush=True)
for i in range(start, steps):
    with rz.step():
        w = w + 0.5 * (1.0 - w)
        time.sleep(0.0 if os.path.exists(GATE) else 0.05)
    print(f"step {i + 1}", flush=True)
    if (i + 1) % every == 0 or rz.should_save():
        path = rz.staging_path("state.json")
        path.write_text(json.dumps({"step": i + 1, "w": w}))
        rz.backup(path, step=i + 1)
rz.close()
print("done", flush=True)
"""
STEPS, SAVE_EVERY = 240, 25
BORROWER = f"""name: borrower
learners: 1
gpus: 2
gpu_type: FAKE
cpus: 1
memory: 256MiB
max_learner_restarts: 0
checkpoint: {{grace_s: {GRACE_S}}}
framework: {{command: 'python train.py {STEPS} {SAVE_EVERY}'}}
"""
# ignores SIGTERM (the disposition is inherited by `sleep`): only a SIGKILL ends it
STUBBORN_SH = "trap '' TERM\necho running\nwhile true; do sleep 0.2; done\n"
STUBBORN = f"""name: stubborn
learners: 1
gpus: 2
gpu_type: FAKE
cpus: 1
memory: 256MiB
checkpoint: {{grace_s: {GRACE_S}}}
framework: {{command: 'sh run.sh'}}
"""
OWNER = """name: owner
learners: 1
gpus: 2
gpu_type: FAKE
cpus: 1
memory: 256MiB
framework: {command: 'sleep 2'}
"""


@pytest.fixture(scope="module")
def daemon(
    etcd_server: ManagedServer,
    mongo_server: ManagedServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Daemon]:
    data_dir = Path(tmp_path_factory.mktemp("preempt"))
    (data_dir / "cluster.yaml").write_text(CLUSTER)
    (data_dir / "quotas.yaml").write_text(QUOTAS)
    with running_daemon(
        data_dir,
        mongo_server,
        # a database of its own: other tests' jobs must not compete for its GPUs
        database="save_before_preempt",
        etcd=etcd_server,
        services=("api", "scheduler", "lcm"),
        cluster_config=str(data_dir / "cluster.yaml"),
        quota_config=str(data_dir / "quotas.yaml"),
    ) as running:
        yield running


def status(client: Client, job_id: str, wanted: int, timeout_s: float = 120.0) -> job_pb2.Job:
    def probe() -> job_pb2.Job | None:
        job = client.get_job(job_id)
        return job if job.status == wanted else None

    try:
        return wait_for(f"{job_id} {job_pb2.JobStatus.Name(wanted)}", probe, timeout_s)  # type: ignore[arg-type]
    except AssertionError:
        raise AssertionError(f"{job_id} is not {wanted}: {client.get_job(job_id)}") from None


def stdout(daemon: Daemon, job_id: str) -> str:
    path = daemon.config.data_dir / "jobs" / job_id / "learners" / "0" / "stdout.log"
    return path.read_text() if path.exists() else ""


def last_step(text: str) -> int:
    steps = [int(line.split()[1]) for line in text.splitlines() if line.startswith("step ")]
    return steps[-1] if steps else 0


def committed(daemon: Daemon, job_id: str) -> list[dict[str, Any]]:
    """The SDK's own log of the checkpoints it committed (its events.jsonl)."""
    out: list[dict[str, Any]] = []
    for path in (daemon.config.data_dir / "jobs" / job_id).rglob("events.jsonl"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "committed":
                out.append(event)
    return sorted(out, key=lambda e: float(e["time"]))


def placed_at(job: job_pb2.Job) -> float:
    """When the scheduler placed the job (its move to PENDING): the same pass decided
    the preemption that made room for it."""
    times = [e.time.ToDatetime().timestamp() for e in job.history if e.status == job_pb2.PENDING]
    assert times, job
    return min(times)


def preempt(daemon: Daemon, files: dict[str, str], manifest: str, ready: str) -> tuple[str, str]:
    """The borrower's job runs until `ready` is in its output, then the owner's job takes
    its GPUs back. Returns (borrower's job, owner's job)."""
    with token_client(daemon, "borrower") as b, token_client(daemon, "owner") as a:
        borrowed = b.create_job(manifest, code_zip(files)).job_id
        status(b, borrowed, job_pb2.PROCESSING)
        wait_for(f"{ready!r} in the output", lambda: ready in stdout(daemon, borrowed), 120)
        owned = a.create_job(OWNER).job_id
        return borrowed, owned


def test_a_preempted_job_saves_first_and_resumes_from_that_save(daemon: Daemon) -> None:
    gate = daemon.config.data_dir / "go"
    train = TRAIN.replace("GATE", repr(str(gate)))
    borrowed, owned = preempt(daemon, {"train.py": train}, BORROWER, f"step {SAVE_EVERY + 5}\n")
    with token_client(daemon, "borrower") as b, token_client(daemon, "owner") as a:
        halted = status(b, borrowed, job_pb2.HALTED)
        # who preempted it and why
        assert f"for job {owned}" in halted.status_message, halted.status_message
        assert "owner of the quota it borrowed needs it back" in halted.status_message
        assert halted.history[-1].message == halted.status_message
        assert "was killed" not in halted.status_message  # it saved and left in its grace
        decided = placed_at(status(a, owned, job_pb2.COMPLETED))

        # the emergency save: after the decision, at the last step the script finished,
        # beyond its last periodic save
        saves = committed(daemon, borrowed)
        emergency = [s for s in saves if s["kind"] == "emergency"]
        assert len(emergency) == 1, saves
        saved = emergency[0]
        assert float(saved["time"]) > decided
        before = [s for s in saves if s["kind"] == "periodic" and s["time"] < saved["time"]]
        assert before and saved["step"] > max(int(s["step"]) for s in before), saves
        first_run = stdout(daemon, borrowed)
        assert last_step(first_run) == saved["step"], "steps finished before the halt were lost"
        assert "done" not in first_run

        # not a failure: with max_learner_restarts: 0 a learner exit counted against it
        # would have failed the job; no deploy attempt was counted either
        assert halted.attempts == 0
        assert not [e for e in halted.history if e.status == job_pb2.FAILED]
        assert not [e for e in halted.history if "restart" in e.message], halted.history

        # resumed, it continues from the emergency checkpoint's step
        gate.touch()
        assert b.resume_job(borrowed).status == job_pb2.QUEUED
        done = status(b, borrowed, job_pb2.COMPLETED, timeout_s=180)
        second_run = stdout(daemon, borrowed)
        assert f"start from {saved['step']}\n" in second_run, second_run[:400]
        assert "start from 0\n" not in second_run.split(f"start from {saved['step']}")[-1]
        assert "done" in second_run
        assert done.attempts == 0
        b.delete_job(borrowed)
        a.delete_job(owned)


def test_a_script_that_ignores_sigterm_is_killed_after_its_grace(daemon: Daemon) -> None:
    borrowed, owned = preempt(daemon, {"run.sh": STUBBORN_SH}, STUBBORN, "running\n")
    with token_client(daemon, "borrower") as b, token_client(daemon, "owner") as a:
        halted = status(b, borrowed, job_pb2.HALTED, timeout_s=GRACE_S + 60)
        assert f"for job {owned}" in halted.status_message, halted.status_message
        assert f"did not stop within its {GRACE_S} s grace" in halted.status_message
        assert "learner 0 " in halted.status_message and "was killed" in halted.status_message
        assert not procs.labelled(borrowed), "a learner process outlived the halt"
        status(a, owned, job_pb2.COMPLETED)
        b.delete_job(borrowed)
        a.delete_job(owned)
