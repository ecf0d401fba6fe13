"""Reconfiguration (Bamboo §4.3): replacements join, redundancy comes back, refusals.

The admission rules run against the real etcd (the cluster state the workers use); the
end-to-end test runs the launcher's worker processes with real SIGKILLs: a stage is
killed, its shadow fails over, a replacement joins and takes its block back (every block
has a replica again), the same block is killed a second time and survived the same way,
and the final parameters equal the uninterrupted single-process reference.
"""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from learner.runtime.cluster_state import ClusterState, EtcdClusterStateStore
from learner.runtime.reconfigure import Refused, admit, issue_ticket
from services.embedded.process import ManagedServer
from tests.learner.runtime.helpers import lose
from tests.learner.runtime.test_failover import REPO, assert_equals_reference, launcher_argv

pytestmark = pytest.mark.integration


def _store(etcd: ManagedServer) -> EtcdClusterStateStore:
    return EtcdClusterStateStore(etcd.url, f"t-{uuid.uuid4().hex[:10]}")


def _fresh(etcd: ManagedServer, stages: int = 3) -> EtcdClusterStateStore:
    store = _store(etcd)
    assert store.set_state(ClusterState(generation=0, stages=stages, pipelines=1), 0)
    return store


def test_a_replacement_with_a_valid_ticket_takes_its_lost_slot(etcd_server: ManagedServer) -> None:
    store = _fresh(etcd_server)
    lose(store, 1)
    ticket = issue_ticket(store, 1, "tok-a")
    joiner = EtcdClusterStateStore(etcd_server.url, store.prefix.rstrip("/").split("/")[-2])
    try:
        assert admit(joiner, 1, ticket.token, ttl_s=2, log=lambda _m: None) == 1
        state, _ = store.get_state()
        assert state is not None
        assert state.dead == () and state.generation == 2 and state.joined_at == {"1": 2}
        # the new member is alive before the running workers see the new generation
        assert 1 in store.alive_members()
    finally:
        joiner.close()
        store.delete_all()
        store.close()


def test_unknown_or_reused_tokens_are_refused(etcd_server: ManagedServer) -> None:
    store = _fresh(etcd_server)
    try:
        lose(store, 2)
        issue_ticket(store, 2, "right")
        with pytest.raises(Refused, match="stale or unknown"):
            admit(store, 2, "wrong", ttl_s=2, log=lambda _m: None)
        assert admit(store, 2, "right", ttl_s=2, log=lambda _m: None) == 2
        lose(store, 2)
        with pytest.raises(Refused, match="joins once"):
            admit(store, 2, "right", ttl_s=2, log=lambda _m: None)
    finally:
        store.delete_all()
        store.close()


def test_a_ticket_of_an_earlier_loss_is_refused_as_stale(etcd_server: ManagedServer) -> None:
    store = _fresh(etcd_server)
    try:
        lose(store, 1)
        old = issue_ticket(store, 1, "first-loss")  # never used: a standby took the slot
        issue_ticket(store, 7, "standby")
        assert admit(store, 7, "standby", ttl_s=2, log=lambda _m: None) == 1
        lose(store, 1)  # the slot is lost again, after the standby joined
        # the replacement started for the first loss arrives only now
        store.put("tickets/1", {"token": old.token, "generation": old.generation})
        with pytest.raises(Refused, match="stale generation"):
            admit(store, 1, "first-loss", ttl_s=2, log=lambda _m: None)
        state, _ = store.get_state()
        assert state is not None and 1 in state.dead  # refused, not merged
    finally:
        store.delete_all()
        store.close()


def test_a_joiner_of_a_fatally_lost_job_is_refused(etcd_server: ManagedServer) -> None:
    store = _fresh(etcd_server)
    try:
        state, token = store.get_state()
        assert state is not None
        assert store.set_state(state.bump(dead=(0, 1), fatal="lost stages 0 and 1"), token)
        issue_ticket(store, 0, "late")
        with pytest.raises(Refused, match="shadow"):
            admit(store, 0, "late", ttl_s=2, log=lambda _m: None)
    finally:
        store.delete_all()
        store.close()


def test_a_standby_queues_while_nothing_is_lost_and_takes_the_next_lost_slot(
    etcd_server: ManagedServer, tmp_path: Path
) -> None:
    store = _fresh(etcd_server)
    job = store.prefix.rstrip("/").split("/")[-2]
    issue_ticket(store, 5, "stand")
    script = (
        "import sys; from learner.runtime.cluster_state import EtcdClusterStateStore as S;"
        "from learner.runtime.reconfigure import admit;"
        f"s = S({etcd_server.url!r}, {job!r});"
        "print('slot', admit(s, 5, 'stand', ttl_s=2), flush=True)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "queued" in line, line
        assert store.get_prefix("standbys/"), "a queued standby is visible under standbys/"
        lose(store, 2)
        out, _ = proc.communicate(timeout=60)
        assert "slot 2" in out, out
        state, _ = store.get_state()
        assert state is not None and state.dead == ()
        assert not store.get_prefix("standbys/")
        # the used ticket names the slot it took: the guardian names the standby from it
        ticket = store.get("tickets/5")
        assert ticket is not None and ticket["slot"] == 2
        assert ticket["used_at"] == state.generation
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        store.delete_all()
        store.close()


REPLACED_STEPS = 12


def _run_replacing(etcd: ManagedServer, out: Path, stages: int, pipelines: int, kill: str) -> str:
    """The toy job for REPLACED_STEPS steps with `--replace`, ``kill``ing twice; the gates
    hold the first stage's batches while a replacement starts: step 4 waits for the first
    replacement (generation 2), step 8 for the second. Its stderr, once it succeeded."""
    argv = launcher_argv(
        etcd,
        out,
        stages,
        pipelines,
        REPLACED_STEPS,
        kill,
        detection_timeout_s=300,
        launcher_args=["--replace"],
        toy_args=["--gate", "4:2,8:4"],
    )
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


def test_replacements_restore_redundancy_and_a_second_loss_of_the_block_is_survived(
    etcd_server: ManagedServer, tmp_path: Path
) -> None:
    out, steps = tmp_path / "params", REPLACED_STEPS
    err = _run_replacing(etcd_server, out, 3, 1, "1:2:forward:1,1:6:backward:0")
    # first loss: failover (the shadow, worker 0, owns blocks 0 and 1)
    assert "[worker 0] joined generation 1" in err and "owns blocks [0, 1]" in err, err[-4000:]
    # the replacement joins: block 1 back to its slot, every block has a replica again
    assert "[worker 0] demoted block 1 to replica" in err
    assert re.search(r"\[worker 1\] received block 1 at version \d+ from worker 0", err)
    assert re.search(r"\[worker 1\] received block 2 \(replica\) at version \d+ from worker 2", err)
    assert re.search(r"\[worker 0\] joined generation 2 .*owns blocks \[0\], replica 1", err)
    assert re.search(r"\[worker 1\] joined generation 2 .*owns blocks \[1\], replica 2", err)
    assert re.search(r"\[worker 2\] joined generation 2 .*owns blocks \[2\], replica 0", err)
    # the same block lost again after the reconfiguration: survived, and restored again
    assert "SIGKILL self at step 6" in err
    assert re.search(r"\[worker 0\] joined generation 3 .*owns blocks \[0, 1\]", err)
    assert re.search(r"\[worker 1\] joined generation 4 .*owns blocks \[1\], replica 2", err)
    # (the second replacement may join at the end: everyone then restarts "step 12")
    assert f"[worker 1] finished: {steps} steps, blocks [1] of pipeline 0, generation 4" in err
    assert_equals_reference(out, pipelines=1, steps=steps)


def test_reconfiguration_in_a_data_parallel_pipeline_restores_redundancy_twice(
    etcd_server: ManagedServer, tmp_path: Path
) -> None:
    """D > 1 (P=2 × D=2): worker 3 (stage 1 of pipeline 1) is killed mid-forward at step
    2 and its replacement mid-backward at step 6. Only pipeline 1 fails over (its shadow,
    worker 2, merges block 1); pipeline 0 has nothing left of the step and only re-runs
    the all-reduce, which from then on spans worker 1 and the merged worker 2. Each
    replacement is handed block 1 and the replica of block 0 by worker 2 and joins; every
    worker of both pipelines re-forms at the same step boundary; the parameters of all
    four workers equal the uninterrupted run's (the global batch spans both pipelines)."""
    out, steps = tmp_path / "params", REPLACED_STEPS
    err = _run_replacing(etcd_server, out, 2, 2, "3:2:forward:1,3:6:backward:0")
    # the loss is pipeline 1's: its shadow merges block 1, pipeline 0 only re-runs the
    # all-reduce
    assert re.search(r"\[worker 2\] joined generation 1 .*owns blocks \[0, 1\]", err), err[-4000:]
    assert re.search(r"\[worker 0\] joined generation 1 .*pipeline 0: nothing left", err)
    for generation, version in ((2, 4), (4, 8)):
        # the replacement gets block 1 and the replica of block 0 from worker 2, and the
        # four workers re-form at the same step boundary with every block replicated
        assert f"[worker 3] received block 1 at version {version} from worker 2" in err, err
        assert f"[worker 3] received block 0 (replica) at version {version} from worker 2" in err
        for worker, owns in ((0, "[0], replica 1"), (1, "[1], replica 0"), (2, "[0], replica 1")):
            assert re.search(
                rf"\[worker {worker}\] joined generation {generation} .*\(reconfiguration\): "
                rf"owns blocks {re.escape(owns)}, step {version} from its start",
                err,
            ), err[-4000:]
        assert re.search(
            rf"\[worker 3\] joined generation {generation} .*owns blocks \[1\], replica 0", err
        )
    assert err.count("[worker 2] demoted block 1 to replica") == 2
    assert re.search(r"\[worker 2\] joined generation 3 .*owns blocks \[0, 1\]", err)
    for worker in range(4):
        stage, pipeline = worker % 2, worker // 2
        assert (
            f"[worker {worker}] finished: {steps} steps, blocks [{stage}] of pipeline "
            f"{pipeline}, generation 4" in err
        ), err[-4000:]
    assert sorted(p.name for p in out.iterdir()) == [f"worker{w}.pt" for w in range(4)]
    assert_equals_reference(out, pipelines=2, steps=steps)


def test_a_standby_started_before_generation_0_waits_for_it_instead_of_being_refused(
    etcd_server: ManagedServer,
) -> None:
    """The launcher starts its standbys with the workers: one may ask to join before
    worker 0 has written generation 0. It waits for the state, then queues and takes the
    first lost slot, as any standby does; with no state at all it is refused, naming
    why."""
    store = _store(etcd_server)
    issue_ticket(store, 4, "early")
    waiting, result = threading.Event(), queue.Queue[int | BaseException]()

    def log(message: str) -> None:
        if "waiting for the job's generation 0" in message:
            waiting.set()

    def join() -> None:
        try:
            result.put(admit(store, 4, "early", ttl_s=2, log=log, start_timeout_s=300))
        except BaseException as exc:  # handed to the test thread, which raises it
            result.put(exc)

    joiner = threading.Thread(target=join, daemon=True)
    joiner.start()
    try:
        assert waiting.wait(60), "the standby did not report waiting for generation 0"
        assert result.empty(), result.get()  # neither refused nor admitted yet
        # the workers start: generation 0, then slot 1 is lost
        assert store.set_state(ClusterState(generation=0, stages=2, pipelines=1), 0)
        lose(store, 1)
        got = result.get(timeout=60)
        if isinstance(got, BaseException):
            raise got
        assert got == 1
        state, _ = store.get_state()
        assert state is not None and state.dead == () and state.joined_at == {"1": 2}
    finally:
        joiner.join(timeout=10)
        store.delete_all()
        store.close()


def test_a_joiner_of_a_job_that_never_started_is_refused_naming_why(
    etcd_server: ManagedServer,
) -> None:
    store = _store(etcd_server)
    try:
        issue_ticket(store, 4, "nobody")
        with pytest.raises(Refused, match=r"no running job to join.*start the job's workers"):
            admit(store, 4, "nobody", ttl_s=2, log=lambda _m: None, start_timeout_s=0)
    finally:
        store.delete_all()
        store.close()
