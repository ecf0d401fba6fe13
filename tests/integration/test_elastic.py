"""Elastic data-parallel jobs with real etcd and real worker processes
(examples/elastic-regression/train.py on gloo): scale out and in while training, a worker
and the leader SIGKILLed, a straggler scaled in, a stale joiner refused. After each:
every process that stayed finishes, the step counter never goes back, every epoch's
samples are used exactly once, and the final parameters equal a single-process replay of
the same effective sample order."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from contract import etcd_keys as keys
from contract.etcd import EtcdClient
from learner.elastic.api import StaleGeneration
from learner.elastic.rendezvous import Rendezvous
from services.embedded.process import ManagedServer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "elastic-regression" / "train.py"
SAMPLES = 192


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("elastic_regression", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Job:
    """Worker processes of one elastic job, each logging its committed steps."""

    def __init__(self, etcd_url: str, tmp: Path, epochs: int) -> None:
        self.etcd_url = etcd_url
        self.tmp = tmp
        self.epochs = epochs
        self.id = f"el-{uuid.uuid4().hex[:8]}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        (tmp / "out").mkdir()

    def start(self, worker: str, *extra: str) -> subprocess.Popen[bytes]:
        argv = [
            sys.executable,
            str(EXAMPLE),
            "--job",
            self.id,
            "--etcd",
            self.etcd_url,
            "--worker",
            worker,
            "--epochs",
            str(self.epochs),
            "--samples",
            str(SAMPLES),
            "--batch-size",
            "4",
            "--block-size",
            "16",
            "--sample-log",
            str(self.tmp / f"log-{worker}.jsonl"),
            "--out",
            str(self.tmp / "out"),
            "--verbose",
            *extra,
        ]
        out = (self.tmp / f"{worker}.out").open("wb")
        proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=self.env()
        )
        self.procs[worker] = proc
        return proc

    @staticmethod
    def env() -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}

    def records(self) -> list[dict[str, Any]]:
        out = []
        for path in sorted(self.tmp.glob("log-*.jsonl")):
            out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return out

    def steps(self) -> int:
        return max((r["step"] + 1 for r in self.records() if "samples" in r), default=0)

    def wait_for(self, what: str, cond: Callable[[], bool], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            for name, proc in self.procs.items():
                if proc.poll() not in (None, 0, -9):
                    raise AssertionError(
                        f"{name} exited {proc.returncode} while waiting for {what}:\n{self.output(name)}"
                    )
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; outputs:\n{self.outputs()}")
            time.sleep(0.05)

    def output(self, worker: str) -> str:
        return (self.tmp / f"{worker}.out").read_text(errors="replace")[-3000:]

    def outputs(self) -> str:
        return "\n".join(f"--- {w}\n{self.output(w)}" for w in self.procs)

    def finish(self, timeout: float = 180) -> dict[str, int]:
        codes = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise AssertionError(f"{name} did not finish; outputs:\n{self.outputs()}") from None
        return codes

    def stop(self) -> dict[str, int]:
        """SIGTERM every live worker (each leaves at a boundary), then wait for all."""
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        return self.finish()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()

    def leader(self) -> str:
        client = EtcdClient.connect(self.etcd_url)
        try:
            entry = client.get(keys.elastic_leader(self.id))
            assert entry is not None, "no leader key"
            return str(entry.value)
        finally:
            client.close()


@pytest.fixture
def job(etcd_server: ManagedServer, tmp_path: Path) -> Iterator[Job]:
    j = Job(etcd_server.url, tmp_path, epochs=1000)  # runs until the test stops it
    try:
        yield j
    finally:
        j.stop_all()


def committed_steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per step (several workers log the same step: they must agree)."""
    by_step: dict[int, dict[str, Any]] = {}
    for rec in records:
        if "samples" not in rec:
            continue
        seen = by_step.setdefault(rec["step"], rec)
        assert (seen["epoch"], seen["samples"]) == (rec["epoch"], rec["samples"]), (
            f"step {rec['step']} logged two ways"
        )
    steps = [by_step[s] for s in sorted(by_step)]
    assert [r["step"] for r in steps] == list(range(len(steps))), (
        "a step is missing: the counter jumped"
    )
    return steps


def assert_exactly_once(steps: list[dict[str, Any]]) -> None:
    """Every finished epoch used each sample exactly once; the open one none twice."""
    last = steps[-1]["epoch"]
    assert last >= 1, "the test stopped the job before it finished an epoch"
    for epoch in range(last + 1):
        used = [
            i for r in steps if r["epoch"] == epoch for ids in r["samples"].values() for i in ids
        ]
        if epoch < last:
            assert sorted(used) == list(range(SAMPLES)), (
                f"epoch {epoch}: not every sample exactly once"
            )
        else:
            assert len(used) == len(set(used)), f"epoch {epoch}: a sample used twice"


def assert_counters_never_go_back(records: list[dict[str, Any]]) -> None:
    by_worker: dict[str, list[int]] = {}
    for rec in records:
        if "samples" in rec:
            by_worker.setdefault(rec["worker"], []).append(rec["step"])
    for worker, steps in by_worker.items():
        assert steps == sorted(set(steps)), f"{worker}'s step counter went back: {steps}"


def assert_matches_replay(job: Job, steps: list[dict[str, Any]], finishers: list[str]) -> None:
    """Replay the logged order in one process: the same parameters (to float rounding)."""
    ex = example()
    model, data = ex.make_model(), ex.make_dataset(SAMPLES)
    optimizer = ex.make_optimizer(model)
    results = {w: json.loads((job.tmp / "out" / f"{w}.json").read_text()) for w in finishers}
    checkpoints = {r["step"] for r in results.values()}
    states: dict[int, dict[str, torch.Tensor]] = {}
    for rec in steps:
        if rec["step"] in checkpoints:
            states[rec["step"]] = {k: v.clone() for k, v in model.state_dict().items()}
        ids = [i for worker_ids in rec["samples"].values() for i in worker_ids]
        x = torch.stack([data[i][0] for i in ids])
        y = torch.stack([data[i][1] for i in ids])
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    states[len(steps)] = model.state_dict()
    for worker, result in results.items():  # each left at its own step: compare with that prefix
        assert result["step"] in states, f"{worker} stopped at step {result['step']}, past the log"
        for name, value in states[result["step"]].items():
            torch.testing.assert_close(
                torch.tensor(result["params"][name]), value, rtol=1e-4, atol=1e-5
            )


def check(job: Job, finishers: list[str]) -> list[dict[str, Any]]:
    records = job.records()
    steps = committed_steps(records)
    assert_counters_never_go_back(records)
    assert_exactly_once(steps)
    assert_matches_replay(job, steps, finishers)
    return records


def test_scale_out_2_to_4_and_in_4_to_2_while_training(job: Job) -> None:
    for w in ("w0", "w1"):
        job.start(w, "--min-workers", "2", "--step-delay", "0.03")
    job.wait_for("10 steps on 2 workers", lambda: job.steps() >= 10)
    for w in ("w2", "w3"):
        job.start(w, "--step-delay", "0.03")
    job.wait_for(
        "a 4-worker generation", lambda: any(len(r.get("samples", {})) == 4 for r in job.records())
    )
    at_four = job.steps()
    job.wait_for("10 steps on 4 workers", lambda: job.steps() >= at_four + 10)
    for w in ("w2", "w3"):
        os.kill(job.procs[w].pid, signal.SIGTERM)  # graceful: leave at the next boundary
    assert job.procs["w2"].wait(120) == 0 and job.procs["w3"].wait(120) == 0, job.outputs()
    at_two = job.steps()
    job.wait_for("10 more steps on 2 workers", lambda: job.steps() >= at_two + 10)
    codes = job.stop()
    assert codes == {"w0": 0, "w1": 0, "w2": 0, "w3": 0}, job.outputs()
    records = check(job, ["w0", "w1", "w2", "w3"])
    sizes = [len(r["samples"]) for r in committed_steps(records)]
    assert sizes[0] == 2 and 4 in sizes and sizes[at_two + 1] == 2
    assert not [r for r in records if "redone" in r], "a graceful scale event redid a step"


def test_joiners_added_together_enter_in_one_re_form(job: Job) -> None:
    # the guardian's `expect` (services/guardian/elastic.py): two learners are being
    # added; the first ready one waits (the others train on) until the second asks too
    def generation() -> int:
        entry = client.get(keys.elastic_state(job.id))
        return int(entry.value["generation"]) if entry is not None else 0

    for w in ("w0", "w1"):
        job.start(w, "--min-workers", "2", "--step-delay", "0.03")
    job.wait_for("5 steps on 2 workers", lambda: job.steps() >= 5)
    client = EtcdClient.connect(job.etcd_url)
    try:
        client.put(keys.elastic_expect(job.id), {"count": 2, "deadline": time.time() + 300})
        before = generation()
        job.start("w2", "--step-delay", "0.03")
        job.wait_for(
            "w2's join request", lambda: client.get(keys.elastic_join(job.id, "w2")) is not None
        )
        asked = job.steps()
        job.wait_for("10 more steps while w2 waits", lambda: job.steps() >= asked + 10)
        assert generation() == before, "w2 entered alone: two re-forms for one scale-out"
        job.start("w3", "--step-delay", "0.03")
        job.wait_for(
            "a 4-worker generation",
            lambda: any(len(r.get("samples", {})) == 4 for r in job.records()),
        )
        assert generation() == before + 1, "the two joiners did not enter in one re-form"
        assert client.get(keys.elastic_expect(job.id)) is None, "later joins would be held"
    finally:
        client.close()
    codes = job.stop()
    assert codes == {"w0": 0, "w1": 0, "w2": 0, "w3": 0}, job.outputs()
    check(job, ["w0", "w1", "w2", "w3"])


def test_a_worker_sigkilled_mid_epoch_is_removed_and_its_batch_redone(job: Job) -> None:
    for w in ("w0", "w1", "w2"):
        job.start(w, "--min-workers", "3", "--step-delay", "0.03")
    job.wait_for("10 steps", lambda: job.steps() >= 10)
    victim = next(w for w in ("w0", "w1", "w2") if w != job.leader())
    os.kill(job.procs[victim].pid, signal.SIGKILL)
    at_kill = job.steps()
    job.wait_for("10 steps after the kill", lambda: job.steps() >= at_kill + 10)
    codes = job.stop()
    assert codes[victim] == -signal.SIGKILL
    assert all(codes[w] == 0 for w in codes if w != victim), job.outputs()
    records = check(job, [w for w in codes if w != victim])
    assert [r for r in records if "redone" in r], "the lost step was not reported as redone"
    assert len(committed_steps(records)[-1]["samples"]) == 2


def test_the_leader_sigkilled_is_replaced_and_training_continues(job: Job) -> None:
    for w in ("w0", "w1", "w2"):
        job.start(w, "--min-workers", "3", "--step-delay", "0.03")
    job.wait_for("10 steps", lambda: job.steps() >= 10)
    leader = job.leader()
    os.kill(job.procs[leader].pid, signal.SIGKILL)
    job.wait_for("a new leader", lambda: _leader_or_none(job) not in (None, leader))
    at_new = job.steps()
    job.wait_for("10 steps under the new leader", lambda: job.steps() >= at_new + 10)
    codes = job.stop()
    assert all(codes[w] == 0 for w in codes if w != leader), job.outputs()
    check(job, [w for w in codes if w != leader])


def _leader_or_none(job: Job) -> str | None:
    try:
        return job.leader()
    except AssertionError:
        return None


def test_a_straggler_is_scaled_in_and_reported(job: Job) -> None:
    job.start("w0", "--min-workers", "3", "--straggler-window", "4", "--step-delay", "0.01")
    job.start("w1", "--min-workers", "3", "--straggler-window", "4", "--step-delay", "0.01")
    job.start("slow", "--min-workers", "3", "--straggler-window", "4", "--step-delay", "0.15")
    assert job.procs["slow"].wait(180) == 0, job.outputs()  # it left by itself
    client = EtcdClient.connect(job.etcd_url)
    try:
        entry = client.get(keys.elastic_leave(job.id, "slow"))
    finally:
        client.close()
    assert entry is not None and entry.value["reason"].startswith("straggler"), entry
    at_two = job.steps()
    job.wait_for(
        "epoch 1 on 2 workers",
        lambda: job.steps() >= at_two + 10 and max(r.get("epoch", 0) for r in job.records()) >= 1,
    )
    codes = job.stop()
    assert codes == {"w0": 0, "w1": 0, "slow": 0}, job.outputs()
    check(job, ["w0", "w1", "slow"])


def test_stop_resume_from_a_checkpoint_continues_the_epoch_and_the_step(job: Job) -> None:
    ckpt = str(job.tmp / "ckpt.pt")
    for w in ("w0", "w1"):
        job.start(w, "--min-workers", "2", "--step-delay", "0.03", "--checkpoint", ckpt)
    job.wait_for("10 steps", lambda: job.steps() >= 10)
    assert job.stop() == {"w0": 0, "w1": 0}, job.outputs()
    stopped_at = job.steps()
    job.id = f"{job.id}-resumed"  # a new job, as after a stop-resume through the platform
    job.start("r0", "--step-delay", "0.01", "--checkpoint", ckpt)
    job.wait_for(
        "epoch 1 after the resume",
        lambda: (
            job.steps() >= stopped_at + 10 and max(r.get("epoch", 0) for r in job.records()) >= 1
        ),
    )
    assert job.stop()["r0"] == 0, job.outputs()
    records = check(job, ["r0"])
    resumed = [r["step"] for r in records if r.get("worker") == "r0" and "samples" in r]
    assert resumed[0] == stopped_at, "the resumed job did not continue from the saved step"


def test_a_joiner_with_a_stale_generation_is_refused(etcd_server: ManagedServer) -> None:
    job_id = f"el-{uuid.uuid4().hex[:8]}"
    client = EtcdClient.connect(etcd_server.url)
    leader = Rendezvous(client, job_id, "a")
    joiner = Rendezvous(client, job_id, "b")
    try:
        leader.request_join(0)
        assert leader.is_leader()
        current, token = leader.membership()
        first = leader.form_next(current, token)
        assert first is not None and first.members == ("a",)
        joiner.request_join(0)  # it read generation 0; the job is at 1
        leader.ack(1, 0)
        current, token = leader.membership()
        second = leader.form_next(current, token)
        assert second is not None and second.members == ("a",)
        with pytest.raises(StaleGeneration, match="stale generation 0; the job is at 1"):
            joiner.check_refused(0)
    finally:
        joiner.close()
        leader.close()
        client.delete_prefix(keys.elastic_prefix(job_id))
        client.close()
