"""Pipeline jobs through the whole embedded platform (real etcd, the local backend).

Each learner is one worker of the pipeline runtime (worker = rank): the manifest's
command is the training script, the learner controller gives it the runtime's
environment, and the rendezvous store lives in the platform's etcd. A SIGKILLed learner
is the runtime's failover, not a restart: the job stays PROCESSING, its history names
who serves the lost stage, and the final parameters equal an uninterrupted run's.
The model is the runtime's float64 toy (learner/runtime/toy.py), compared with the
single-process reference by the runtime's own helpers (tests/learner/runtime).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from contract import procs
from contract.env import Role
from tests.integration.test_cli import embedded_up, rz
from tests.integration.test_isolation import traversable_data_dir
from tests.learner.runtime.test_failover import assert_equals_reference
from tests.learner.runtime.test_growth import assert_equals_grown_reference
from tests.services.guardian.helpers import describe_job, wait_for

pytestmark = pytest.mark.integration

# Says its uid first: the module's platform runs learners as the platform does by default.
SCRIPT = (
    "import os\nimport sys\n\nfrom learner.runtime.toy import main\n\n"
    'print(f"learner uid {os.getuid()}", file=sys.stderr, flush=True)\nmain()\n'
)


def manifest(stages: int, steps: int, name: str, more: str = "", args: str = "") -> str:
    """A toy pipeline job; `more`: more fields of its `pipeline:` section ("k: v, ..."),
    `args`: more options of the toy (``--gate ...``)."""
    return (
        f"name: {name}\nmemory: 512MiB\nmax_learner_restarts: 2\n"
        f"framework:\n  command: python train.py --steps {steps}{' ' + args if args else ''}\n"
        f"pipeline: {{stages: {stages}, pipelines: 1{', ' + more if more else ''}}}\n"
    )


@pytest.fixture(scope="module")
def platform() -> Iterator[Path]:
    """The platform's defaults, learner uids included: each job's workers run under a uid
    of their own (the rest of the suite runs learners as the test's user)."""
    with (
        traversable_data_dir("rhizome-pipeline-jobs-") as path,
        embedded_up(path, learner_uids=True) as data_dir,
    ):
        yield data_dir


def submit(
    platform: Path, tmp: Path, stages: int, steps: int, name: str, more: str = "", args: str = ""
) -> str:
    """`manifest(...)`'s toy job through `rhizome train`: its id."""
    return submit_manifest(platform, tmp, manifest(stages, steps, name, more, args))


def submit_manifest(platform: Path, tmp: Path, text: str) -> str:
    code = tmp / "code"
    code.mkdir()
    (code / "train.py").write_text(SCRIPT)
    (code / "manifest.yml").write_text(text)
    out = rz(platform, "train", str(code / "manifest.yml"), "--json").stdout
    return str(json.loads(out)["job_id"])


def show(platform: Path, job_id: str) -> dict[str, Any]:
    return dict(json.loads(rz(platform, "show", job_id, "--json").stdout))


def wait_end(platform: Path, job_id: str, timeout_s: float = 90) -> dict[str, Any]:
    """The job once it ended (`rhizome show --json`); on time-out the failure prints its
    history and its learners' last lines."""

    def ended() -> dict[str, Any] | None:
        job = show(platform, job_id)
        return job if job["status"] in ("COMPLETED", "FAILED", "HALTED", "DELETED") else None

    return wait_for(f"job {job_id}'s end", ended, timeout_s, lambda: report(platform, job_id))


def learner_file(platform: Path, job_id: str, rank: int, name: str) -> str:
    path = platform / "jobs" / job_id / "learners" / str(rank) / name
    return path.read_text() if path.exists() else ""


def report(platform: Path, job_id: str) -> str:
    """What a wait that timed out prints: the job's status and history (`rhizome show`),
    the last lines of each learner's stderr."""
    job = show(platform, job_id)
    entries = [(str(h["status"]), str(h["message"])) for h in job["history"]]
    return describe_job(job_id, job["status"], job.get("status_message", ""), entries, platform)


def gather_params(platform: Path, job_id: str, into: Path) -> list[str]:
    """Every worker's saved parameters (results/<job>/<rank>/worker<rank>.pt) in one folder."""
    into.mkdir()
    names = []
    for f in sorted((platform / "objects" / "results" / job_id).glob("*/worker*.pt")):
        shutil.copy(f, into / f.name)
        names.append(f"{f.parent.name}/{f.name}")
    return names


def worker_pids(job_id: str, rank: int) -> list[int]:
    """The python processes of a learner's command (not its shell wrappers)."""
    out = []
    for pid in procs.labelled(job_id, rank, Role.LEARNER):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"train.py" in argv and b"python" in Path(argv[0].decode()).name.encode():
            out.append(pid)
    return out


def test_a_pipeline_job_runs_each_stage_once_in_its_own_learner(
    platform: Path, tmp_path: Path
) -> None:
    steps = 4
    # metrics_every: each worker's runtime metrics for steps 0-2, then the partial 3
    job_id = submit(platform, tmp_path, 2, steps, "pipe-ok", more="metrics_every: 3")
    job = wait_end(platform, job_id)
    assert job["status"] == "COMPLETED", job
    learners = sorted(p.name for p in (platform / "jobs" / job_id / "learners").iterdir())
    assert learners == ["0", "1"]  # P x D learners, no more
    for rank in (0, 1):
        err = learner_file(platform, job_id, rank, "stderr.log")
        # under the platform's default isolation: the job's own uid, never the daemon's
        uids = re.findall(r"learner uid (\d+)", err)
        assert len(uids) == 1 and int(uids[0]) >= 20000, err
        # one worker per learner, started once, trained its own stage once
        assert err.count("started:") == 1, err
        assert f"[worker {rank}] started: stage {rank} of pipeline 0" in err, err
        assert err.count("finished:") == 1, err
        assert f"[worker {rank}] finished: {steps} steps, blocks [{rank}]" in err, err
        assert "rhizome-runtime: worker" not in err  # no launcher inside a learner
    # the last stage reports each step once
    out = learner_file(platform, job_id, 1, "stdout.log")
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == [
        str(s) for s in range(steps)
    ]
    # `rhizome show` says where each stage runs and why: the scheduler put the two stages
    # (each the other's shadow) in different zones of the local cluster
    stages = show(platform, job_id)["stages"]
    assert [(r["learner"], r["stage"]) for r in stages] == [(0, 0), (1, 1)]
    assert stages[0]["zone"] != stages[1]["zone"], stages
    assert (
        stages[1]["why"] == f"zone-aware: its shadow, learner 0, runs in zone {stages[0]['zone']}"
    )
    assert "pipeline stages" in rz(platform, "show", job_id).stdout
    # `rhizome logs --learner N` shows each stage's own lines
    logs1 = rz(platform, "logs", job_id, "--learner", "1").stdout
    assert f"[1/stdout] step {steps - 1} loss" in logs1
    assert "[1/stderr] [worker 1] started: stage 1" in logs1
    logs0 = rz(platform, "logs", job_id, "--learner", "0").stdout
    assert "[0/stderr] [worker 0] started: stage 0" in logs0 and "[1/" not in logs0
    # each worker saved the blocks it owns to its learner's results: together, the
    # parameters of the single-process reference run
    saved = gather_params(platform, job_id, tmp_path / "params")
    assert saved == ["0/worker0.pt", "1/worker1.pt"]
    assert_equals_reference(tmp_path / "params", pipelines=1, steps=steps)
    # `pipeline.metrics_every: 3` reached the workers: a sample per window of 3 steps
    samples = json.loads(rz(platform, "metrics", job_id, "--json").stdout)
    iter_steps = {
        rank: sorted(
            s["step"] for s in samples if s["learner"] == rank and s["name"] == "runtime/iter_ms"
        )
        for rank in (0, 1)
    }
    assert iter_steps == {0: [2, 3], 1: [2, 3]}, samples
    # and `--plot` draws them (a panel per metric); a name that is not .png is refused
    rz(platform, "metrics", job_id, "--plot", str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    refused = rz(platform, "metrics", job_id, "--plot", str(tmp_path / "c.jpg"), check=False)
    assert refused.returncode == 1 and "give a file name ending in .png" in refused.stderr


def test_a_sigkilled_learner_is_the_runtimes_failover_not_a_restart(
    platform: Path, tmp_path: Path
) -> None:
    steps = 60
    job_id = submit(platform, tmp_path, stages=2, steps=steps, name="pipe-kill")
    deadline = time.monotonic() + 60
    while "step 2 " not in learner_file(platform, job_id, 1, "stdout.log"):
        assert time.monotonic() < deadline, show(platform, job_id)
        time.sleep(0.05)
    victims = worker_pids(job_id, 1)
    assert victims, "learner 1's worker is not running"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    # the failover is named in the history while the job goes on PROCESSING
    expected = "learner 1 preempted; stage 1 now served by learner 0 (generation 1)"
    while True:
        job = show(platform, job_id)
        notes = [h for h in job["history"] if h["message"] == expected]
        if notes:
            break
        assert job["status"] == "PROCESSING", job
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
    assert notes[0]["status"] == "PROCESSING"
    job = wait_end(platform, job_id)
    assert job["status"] == "COMPLETED", job
    # one preemption: a replacement that the runtime refused (the job was finishing)
    # retires unused; it is not counted as a second loss
    failovers = [h for h in job["history"] if h["message"].startswith("learner 1 preempted")]
    assert len(failovers) == 1, job["history"]
    assert job["status_message"].startswith("every "), job["status_message"]
    statuses = [h["status"] for h in job["history"]]
    # deployed once, never recovered or restarted
    assert statuses.count("DEPLOYING") == 1 and "RECOVERING" not in statuses, statuses
    err1 = learner_file(platform, job_id, 1, "stderr.log")
    assert err1.count("started:") == 1, err1  # the victim was not started again
    err0 = learner_file(platform, job_id, 0, "stderr.log")
    assert "promoted replica of block 1" in err0, err0
    assert f"[worker 0] finished: {steps} steps, blocks [0, 1] of pipeline 0, generation 1" in err0
    out0 = learner_file(platform, job_id, 0, "stdout.log")
    assert f"step {steps - 1} loss" in out0 and "generation 1" in out0.splitlines()[-1]
    # the survivor holds the whole model: equal to the uninterrupted run of the same seed
    assert gather_params(platform, job_id, tmp_path / "params") == ["0/worker0.pt"]
    assert_equals_reference(tmp_path / "params", pipelines=1, steps=steps)


def test_losing_a_stage_and_its_shadow_restarts_the_job_from_its_checkpoint(
    platform: Path, tmp_path: Path
) -> None:
    """A fatal loss (stages 1 and 2 of 3, a stage and its shadow) is not a FAILED job:
    the guardian restarts every learner, the runtime starts from its latest complete
    block checkpoint (every 10 steps), the history records the restart, the job
    completes with the parameters of the uninterrupted run."""
    steps = 120
    job_id = submit(platform, tmp_path, stages=3, steps=steps, name="pipe-fatal")
    deadline = time.monotonic() + 90
    while "step 25 " not in learner_file(platform, job_id, 2, "stdout.log"):
        assert time.monotonic() < deadline, show(platform, job_id)
        time.sleep(0.05)
    victims = worker_pids(job_id, 1) + worker_pids(job_id, 2)
    assert len(victims) == 2
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    job = wait_end(platform, job_id, timeout_s=180)
    assert job["status"] == "COMPLETED", job
    history = [(h["status"], h["message"]) for h in job["history"]]
    recovering = [m for st, m in history if st == "RECOVERING"]
    assert len(recovering) == 1, history
    assert recovering[0].startswith(
        "pipeline runtime: fatal: pipeline 0 lost consecutive stages 1 and 2"
    ), recovering
    assert (
        "restarting every learner from the latest checkpoint (restart 1 of at most 2)"
        in (recovering[0])
    )
    statuses = [st for st, _ in history]
    assert statuses.count("DEPLOYING") == 1 and "FAILED" not in statuses, history
    for rank in range(3):
        err = learner_file(platform, job_id, rank, "stderr.log")
        assert err.count("started:") == 2, err  # the first incarnation, then the restart
        restored = re.findall(r"from the checkpoint of step (\d+)", err)
        assert len(restored) == 1 and int(restored[0]) >= 10, err
        assert f"finished: {steps} steps, blocks [{rank}]" in err, err
    assert gather_params(platform, job_id, tmp_path / "params") == [
        "0/worker0.pt",
        "1/worker1.pt",
        "2/worker2.pt",
    ]
    assert_equals_reference(tmp_path / "params", pipelines=1, steps=steps)


def test_lost_learners_are_replaced_redundancy_returns_and_a_second_loss_is_survived(
    platform: Path, tmp_path: Path
) -> None:
    """Reconfiguration on the platform: learner 1 dies mid-step (step 2) → failover →
    the guardian starts a replacement with a ticket → it joins, takes stage 1 back and
    every block has a replica again → the replacement dies mid-step too (step 40) → the
    same failover, a second replacement joins → COMPLETED, parameters equal to the
    uninterrupted run of the same seed. The toy's gates hold steps 30 and 60 until each
    replacement has joined (a learner needs seconds to start)."""
    steps = 80
    job_id = submit(
        platform,
        tmp_path,
        2,
        steps,
        "pipe-reconf",
        args="--die 1:2 --die-replacement 1:40 --gate 30:2,60:4",
    )
    job = wait_end(platform, job_id, timeout_s=600)
    assert job["status"] == "COMPLETED", job
    messages = [h["message"] for h in job["history"]]
    expected = [
        "learner 1 preempted; stage 1 now served by learner 0 (generation 1)",
        "learner 1 lost: a replacement joins as a standby (replacement 1 of at most 2)",
        "learner 1 replaced: stage 1 served by its own learner again, every block has a "
        "replica (generation 2)",
        "learner 1 preempted; stage 1 now served by learner 0 (generation 3)",
        "learner 1 lost: a replacement joins as a standby (replacement 2 of at most 2)",
        "learner 1 replaced: stage 1 served by its own learner again, every block has a "
        "replica (generation 4)",
    ]
    assert [m for m in messages if m in expected] == expected, messages
    statuses = [h["status"] for h in job["history"]]
    assert statuses.count("DEPLOYING") == 1 and "FAILED" not in statuses, statuses
    err0 = learner_file(platform, job_id, 0, "stderr.log")
    assert err0.count("demoted block 1 to replica") == 2, err0
    err1 = learner_file(platform, job_id, 1, "stderr.log")
    assert err1.count("received block 1 at version") == 2, err1
    assert err1.count("received block 0 (replica)") == 2, err1
    assert "[worker 1] finished: 80 steps, blocks [1] of pipeline 0, generation 4" in err1, err1
    assert gather_params(platform, job_id, tmp_path / "params") == [
        "0/worker0.pt",
        "1/worker1.pt",
    ]
    assert_equals_reference(tmp_path / "params", pipelines=1, steps=steps)


def test_a_standby_takes_a_lost_slot_without_a_cold_start_and_a_new_standby_is_started(
    platform: Path, tmp_path: Path
) -> None:
    """`pipeline.standbys: 1`: the guardian deploys learner 2 beside the two workers; it
    builds the model and queues before anything fails. Learner 1 dies at step 2 → the
    runtime fails over → the waiting standby takes slot 1 at once (no start-up) and every
    block has a replica again → within the job's replacement budget learner 1 restarts
    as the next standby; the job ends, that unused standby is refused and retires (no
    preemption), the job is COMPLETED with the parameters of the uninterrupted run."""
    steps = 60
    # step 40's batches wait until the standby joined (generation 2)
    job_id = submit(
        platform, tmp_path, 2, steps, "pipe-standby", more="standbys: 1", args="--gate 40:2"
    )

    def explain() -> str:
        return report(platform, job_id)

    wait_for(
        "the standby queued",
        lambda: "queued" in learner_file(platform, job_id, 2, "stderr.log"),
        120,
        explain,
    )
    # `rhizome show` lists the standby beside the stages
    stages = show(platform, job_id)["stages"]
    assert [(r["learner"], r["stage"]) for r in stages] == [(0, 0), (1, 1), (2, "standby")]
    # step 2 runs once the pipeline formed: the kill is a failover, not a restart in place
    wait_for(
        "step 2 on learner 1",
        lambda: "step 2 " in learner_file(platform, job_id, 1, "stdout.log"),
        120,
        explain,
    )
    victims = worker_pids(job_id, 1)
    assert victims, "learner 1's worker is not running\n" + explain()
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    job = wait_end(platform, job_id, timeout_s=300)
    assert job["status"] == "COMPLETED", explain()
    messages = [h["message"] for h in job["history"]]

    def index(message: str) -> int:
        found = [i for i, m in enumerate(messages) if m == message]
        assert len(found) == 1, f"{message!r} once in:\n" + "\n".join(messages)
        return found[0]

    loss = index("learner 1 preempted; stage 1 now served by learner 0 (generation 1)")
    admission = index(
        "standby learner 2 took over stage 1 of pipeline 0 (learner 1's slot) without a cold "
        "start, every block has a replica (generation 2)"
    )
    replacement = index(
        "learner 1 lost: a replacement joins as a standby (replacement 1 of at most 2)"
    )
    retired = index("standby learner 1 retired unused: the job finished before a slot was lost")
    # Ordered by cause only: the replacement is issued once the loss is in the history
    # and queues behind the standby's admission, and it retires after it was started. The
    # admission itself may be written before the loss (the guardian can see the standby's
    # compare-and-set before the lost learner's controller wrote FAILED: see
    # tests/services/guardian/test_pipeline_standbys.py).
    assert loss < replacement < retired and admission < replacement, messages
    statuses = [h["status"] for h in job["history"]]
    assert statuses.count("DEPLOYING") == 1, statuses
    assert "RECOVERING" not in statuses and "FAILED" not in statuses, statuses
    # one preemption only: the standby refused at the end is none
    assert sum("preempt" in m for m in messages) == 1, messages
    err2 = learner_file(platform, job_id, 2, "stderr.log")
    assert "standby 2: queued (no lost slot in generation 0)" in err2, err2
    assert "joiner 2: admitted into slot 1 -> generation 2" in err2, err2
    assert "received block 1 at version" in err2, err2
    assert f"[worker 1] finished: {steps} steps, blocks [1] of pipeline 0" in err2, err2
    err1 = learner_file(platform, job_id, 1, "stderr.log")
    assert "REFUSED:" in err1 and "the job is finishing" in err1, err1
    # the standby saved slot 1's blocks in its own learner's results
    assert gather_params(platform, job_id, tmp_path / "params") == [
        "0/worker0.pt",
        "2/worker1.pt",
    ]
    assert_equals_reference(tmp_path / "params", pipelines=1, steps=steps)


def test_two_standbys_grow_the_job_by_a_whole_pipeline(platform: Path, tmp_path: Path) -> None:
    """`pipeline: {stages: 2, pipelines: 1, standbys: 2, max_pipelines: 2}` through
    `rhizome train`: both standbys queue, nothing is lost, so they add a second pipeline
    at a step boundary (the runtime's compare-and-set, generation 1); the guardian writes
    the growth into the history from the runtime's state; the four learners finish, each
    pipeline's parameters equal, and equal to the reference that adds the second
    pipeline's microbatches from the growth step on."""
    steps = 16
    # step 6's batches wait until the job grew (generation 1): standbys need seconds
    job_id = submit(
        platform,
        tmp_path,
        2,
        steps,
        "pipe-grow",
        more="standbys: 2, max_pipelines: 2",
        args="--gate 6:1",
    )
    job = wait_end(platform, job_id, timeout_s=300)
    assert job["status"] == "COMPLETED", report(platform, job_id)
    messages = [h["message"] for h in job["history"]]
    grown = [m for m in messages if m.startswith("pipeline grown")]
    assert grown == [
        "pipeline grown to 2 pipelines: learners 2, 3 took slots 2, 3 (stages 0..1 of "
        "pipeline 1) from the queued standbys, without a cold start (generation 1)"
    ], messages
    statuses = [h["status"] for h in job["history"]]
    assert "RECOVERING" not in statuses and "FAILED" not in statuses, statuses
    assert not any("preempt" in m or "retired" in m for m in messages), messages
    err2 = learner_file(platform, job_id, 2, "stderr.log")
    found = re.search(
        r"joined generation 1 .*\(reconfiguration\).* step (\d+) from its start", err2
    )
    assert found, err2
    grew = int(found.group(1))
    assert f"[worker 2] finished: {steps} steps, blocks [0] of pipeline 1, generation 1" in err2
    assert gather_params(platform, job_id, tmp_path / "params") == [
        f"{w}/worker{w}.pt" for w in range(4)
    ]
    assert_equals_grown_reference(tmp_path / "params", steps, grew)


def wait_step(platform: Path, job_id: str, rank: int, step: int, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while f"step {step} " not in learner_file(platform, job_id, rank, "stdout.log"):
        assert time.monotonic() < deadline, report(platform, job_id)
        time.sleep(0.05)


def test_a_halted_pipeline_job_saves_at_one_step_and_resumes_there(
    platform: Path, tmp_path: Path
) -> None:
    """`rhizome halt` SIGTERMs every learner: the workers agree on a step, each saves its
    blocks there (an emergency checkpoint on the job's record) and leaves; `rhizome
    resume` starts every worker from that step: no step lost, COMPLETED, the parameters
    of an uninterrupted run."""
    steps = 60
    job_id = submit_manifest(
        platform,
        tmp_path,
        f"name: pipe-halt\nmemory: 512MiB\nmax_learner_restarts: 2\n"
        f"framework:\n  command: python train.py --steps {steps} --sleep 0.02\n"
        f"pipeline: {{stages: 2, pipelines: 1}}\ncheckpoint: {{grace_s: 60}}\n",
    )
    wait_step(platform, job_id, 1, 12)  # past the periodic block checkpoint of step 10
    halted = rz(platform, "halt", job_id)
    assert halted.stdout.strip() == f"job {job_id} HALTED", report(platform, job_id)
    saved: list[int] = []
    for rank in (0, 1):
        err = learner_file(platform, job_id, rank, "stderr.log")
        saved += [
            int(s) for s in re.findall(r"emergency block save of blocks \[\d\] at step (\d+)", err)
        ]
    assert len(saved) == 2 and saved[0] == saved[1], report(platform, job_id)
    s = saved[0]
    assert 12 < s < steps

    rz(platform, "resume", job_id)
    job = wait_end(platform, job_id, timeout_s=180)
    assert job["status"] == "COMPLETED", job
    for rank in (0, 1):
        err = learner_file(platform, job_id, rank, "stderr.log")
        restored = re.findall(r"from the checkpoint of step (\d+)", err)
        assert restored == [str(s)], err[-3000:]
    out = learner_file(platform, job_id, 1, "stdout.log")
    resumed = [int(line.split()[1]) for line in out.splitlines() if line.startswith("step ")]
    # the resumed run's first step is s: every step before it was saved, none redone
    assert s in resumed and resumed[resumed.index(s) - 1] == s - 1, resumed

    # the job's record lists both learners' emergency checkpoints at step s (their reports
    # reach the TDS at the same instant: services/store/jobs.py merges them under a lock)
    def reported() -> list[dict[str, Any]] | None:
        got = [c for c in show(platform, job_id).get("checkpoints", []) if c["kind"] == "emergency"]
        return got if {str(c["learner"]) for c in got} == {"0", "1"} else None

    checkpoints = wait_for(
        "the emergency checkpoints on the record",
        reported,
        30,
        lambda: (
            f"checkpoints: {show(platform, job_id).get('checkpoints')}\n" + report(platform, job_id)
        ),
    )
    assert {int(c["step"]) for c in checkpoints} == {s}, checkpoints
    gather_params(platform, job_id, tmp_path / "params")
    assert_equals_reference(tmp_path / "params", pipelines=1, steps=steps)


def test_a_notice_for_one_learner_makes_it_leave_and_the_others_fail_over(
    platform: Path, tmp_path: Path
) -> None:
    """SIGTERM to one learner's worker (its node's notice): it leaves at its next step
    boundary, declaring itself dead, and the job goes on without waiting for the
    detection timeout; the history names the failover; COMPLETED."""
    steps = 60
    job_id = submit_manifest(
        platform,
        tmp_path,
        f"name: pipe-notice\nmemory: 512MiB\nmax_learner_restarts: 0\n"
        f"framework:\n  command: python train.py --steps {steps} --sleep 0.01\n"
        f"pipeline: {{stages: 2, pipelines: 1}}\n",
    )
    wait_step(platform, job_id, 1, 3)
    victims = worker_pids(job_id, 1)
    assert victims, "learner 1's worker is not running"
    for pid in victims:
        os.kill(pid, signal.SIGTERM)
    job = wait_end(platform, job_id, timeout_s=180)
    assert job["status"] == "COMPLETED", job
    messages = [h["message"] for h in job["history"]]
    assert any(
        m.startswith("learner 1 preempted; stage 1 now served by learner 0") for m in messages
    ), messages
    err1 = learner_file(platform, job_id, 1, "stderr.log")
    assert "notice for this worker alone" in err1, err1[-3000:]
    err0 = learner_file(platform, job_id, 0, "stderr.log")
    assert "declared worker 1 dead" not in err0  # it declared itself, at its boundary
    assert gather_params(platform, job_id, tmp_path / "params") == ["0/worker0.pt"]
    assert_equals_reference(tmp_path / "params", pipelines=1, steps=steps)


def test_the_pipeline_gpt_example_trains_through_rhizome_train_as_documented(
    platform: Path,
) -> None:
    """`rhizome train examples/pipeline-gpt/manifest.yaml --wait`, the command the example's
    manifest and docs give, with its own script: it completes with P x D = 2 learners, each
    running one worker that trained its own stage once."""
    example = Path(__file__).resolve().parents[2] / "examples" / "pipeline-gpt"
    proc = rz(platform, "train", str(example / "manifest.yaml"), "--wait")
    # the job's id on stdout, its progress to the end on stderr (exit 0: `rz` checks it)
    assert "COMPLETED every learner finished" in proc.stderr, proc.stdout + proc.stderr
    (job_id,) = set(re.findall(r"job-[0-9a-f]{20,}", proc.stdout))
    learners = sorted(p.name for p in (platform / "jobs" / job_id / "learners").iterdir())
    assert learners == ["0", "1"]
    for rank in (0, 1):
        err = learner_file(platform, job_id, rank, "stderr.log")
        assert err.count("started:") == 1 and err.count("finished:") == 1, err
        assert f"[worker {rank}] started: stage {rank} of pipeline 0" in err, err
        assert "rhizome-runtime: worker" not in err  # no launcher inside a learner
    # each stage's per-step metrics reach `rhizome metrics` through the platform's metric
    # path (contract/runtime_metrics.py): its step time, where its redundant forward ran
    # (the example's mode is eager-frc-lazy-brc), and the last stage's loss
    steps = 40  # the manifest's `--steps 40`
    seen: dict[tuple[int, str], set[int]] = {}
    for s in json.loads(rz(platform, "metrics", job_id, "--json").stdout):
        key = (s["learner"], str(s["name"]))  # every field, numbers as numbers
        seen.setdefault(key, set()).add(s["step"])
    every_step = set(range(steps))
    for rank in (0, 1):
        for name in ("iter_ms", "generation", "frc_bubble_ms", "frc_sync_ms"):
            assert seen.get((rank, f"runtime/{name}")) == every_step, (rank, name, sorted(seen))
    assert seen.get((1, "runtime/loss")) == every_step and (0, "runtime/loss") not in seen
