"""Growth by a whole pipeline (D+1, Bamboo §4.3) from queued standbys.

Through the launcher with the real etcd: P=2 × D=1 with two standbys whose tickets allow
two pipelines — both queue, the job grows to D=2 at a step boundary, the standbys receive
their blocks (and replicas) with optimizer state from pipeline 0 and train as pipeline 1;
the four workers end with equal parameters, equal to the single-process reference that
adds the second pipeline's microbatches from the growth step on. After a growth a loss in
the new pipeline fails over as before. The admission rules (no growth while a slot is
dead, none beyond ``max_pipelines``, stale and used tickets) run against the real etcd.
"""

from __future__ import annotations

import queue
import re
import subprocess
import threading
import uuid
from pathlib import Path

import pytest
import torch

from contract.etcd_watch import Change
from learner.runtime.cluster_state import ClusterState, EtcdClusterStateStore
from learner.runtime.cluster_watch import ClusterView
from learner.runtime.reconfigure import (
    Refused,
    Ticket,
    admit,
    grown_slot,
    issue_ticket,
    lost_growth_joiners,
    plan_growth,
)
from learner.runtime.reference import reference_train
from learner.runtime.toy import toy_job
from services.embedded.process import ManagedServer
from tests.learner.runtime.helpers import lose
from tests.learner.runtime.test_failover import REPO, launcher_argv, saved_params

pytestmark = pytest.mark.integration


def grow_argv(
    etcd: ManagedServer, out: Path, steps: int, extra: list[str], gate: str = "4:1"
) -> list[str]:
    """P=2 × D=1 with two standbys that may grow it to D=2; ``extra`` are launcher options.
    The gate holds step 4 until the growth (standbys need seconds to start)."""
    return launcher_argv(
        etcd,
        out,
        2,
        1,
        steps,
        detection_timeout_s=300,
        launcher_args=["--standbys", "2", "--max-pipelines", "2", *extra],
        toy_args=["--gate", gate],
    )


def growth_step(err: str) -> int:
    """The step the grown job restarted from (every worker joins generation 1 there)."""
    found = re.search(
        r"\[worker 2\] joined generation 1 .*\(reconfiguration\): owns blocks \[0\], "
        r"replica 1, step (\d+) from its start",
        err,
    )
    assert found, err[-4000:]
    return int(found.group(1))


def assert_equals_grown_reference(out: Path, steps: int, grew: int) -> None:
    # saved_params asserts that every pipeline's copy of a block is identical (bitwise)
    got = saved_params(out)
    ref = reference_train(toy_job(steps=steps), 1, grow_at={grew: 2})
    assert set(got) == set(ref)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-9, atol=1e-11, msg=key)
    # and it differs from never growing: the test can tell a growth happened
    never = reference_train(toy_job(steps=steps), 1)
    assert any(not torch.allclose(got[k], never[k]) for k in ref)


def test_two_standbys_grow_the_job_by_a_pipeline_and_it_trains_on(
    etcd_server: ManagedServer, tmp_path: Path
) -> None:
    out, steps = tmp_path / "params", 10
    proc = subprocess.run(
        grow_argv(etcd_server, out, steps, []),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    err = proc.stderr
    assert proc.returncode == 0, err[-4000:]
    assert re.search(r"standby [23]: grew the job to 2 pipelines, standbys \[2, 3\]", err), err
    grew = growth_step(err)
    assert 0 <= grew <= 4
    # the new pipeline's workers get block and replica, parameters and optimizer state,
    # from their owners in pipeline 0
    assert f"[worker 2] received block 0 at version {grew} from worker 0" in err
    assert f"[worker 2] received block 1 (replica) at version {grew} from worker 1" in err
    assert f"[worker 3] received block 1 at version {grew} from worker 1" in err
    assert f"[worker 3] received block 0 (replica) at version {grew} from worker 0" in err
    for worker in range(4):
        stage, pipeline = worker % 2, worker // 2
        assert (
            f"[worker {worker}] finished: {steps} steps, blocks [{stage}] of pipeline "
            f"{pipeline}, generation 1" in err
        ), err[-4000:]
    assert sorted(p.name for p in out.iterdir()) == [f"worker{w}.pt" for w in range(4)]
    assert_equals_grown_reference(out, steps, grew)


def test_a_loss_in_the_grown_pipeline_fails_over_and_a_replacement_takes_the_slot(
    etcd_server: ManagedServer, tmp_path: Path
) -> None:
    """After the growth, worker 3 (stage 1 of the new pipeline 1, a former standby) is
    SIGKILLed mid-forward at step 6: its shadow, worker 2, merges block 1 (failover,
    generation 2); the launcher's replacement for it joins (generation 3) and gets block 1
    and the replica of block 0 back from worker 2; the job completes equal to the
    reference."""
    out, steps = tmp_path / "params", 12
    # step 9 waits for the replacement as well
    argv = grow_argv(
        etcd_server, out, steps, ["--replace", "--kill", "3:6:forward:1"], gate="4:1,9:3"
    )
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    err = proc.stderr
    assert proc.returncode == 0, err[-4000:]
    grew = growth_step(err)
    assert "[worker 3] SIGKILL self at step 6" in err, err[-4000:]
    assert re.search(r"\[worker 2\] joined generation 2 .*owns blocks \[0, 1\]", err), err[-4000:]
    assert "[worker 2] demoted block 1 to replica" in err
    assert re.search(r"\[worker 3\] received block 1 at version \d+ from worker 2", err)
    assert re.search(r"\[worker 3\] received block 0 \(replica\) at version \d+ from worker 2", err)
    for worker in range(4):
        stage, pipeline = worker % 2, worker // 2
        assert (
            f"[worker {worker}] finished: {steps} steps, blocks [{stage}] of pipeline "
            f"{pipeline}, generation 3" in err
        ), err[-4000:]
    assert_equals_grown_reference(out, steps, grew)


# ---------------------------------------------------------------- admission rules


def _formed(etcd: ManagedServer, stages: int = 2, pipelines: int = 1) -> EtcdClusterStateStore:
    """A job whose generation-0 workers have all started (``started/<w>``)."""
    store = EtcdClusterStateStore(etcd.url, f"t-{uuid.uuid4().hex[:10]}")
    assert store.set_state(ClusterState(generation=0, stages=stages, pipelines=pipelines), 0)
    for w in range(stages * pipelines):
        store.put(f"started/{w}", {"generation": 0})
    return store


# the joiners' clients, closed at the end of each test
VIEWS: list[EtcdClusterStateStore] = []


def _admit_in_thread(
    etcd: ManagedServer, job: str, candidate: int, token: str
) -> queue.Queue[int | BaseException]:
    """``admit`` as a standby process runs it: its own client and lease."""
    got: queue.Queue[int | BaseException] = queue.Queue()
    view = EtcdClusterStateStore(etcd.url, job)
    VIEWS.append(view)

    def run() -> None:
        try:
            got.put(admit(view, candidate, token, ttl_s=5, log=lambda _m: None))
        except BaseException as exc:  # handed to the test thread, which raises it
            got.put(exc)

    threading.Thread(target=run, daemon=True).start()
    return got


def _result(got: queue.Queue[int | BaseException]) -> int:
    value = got.get(timeout=60)
    if isinstance(value, BaseException):
        raise value
    return value


def test_plan_growth_is_due_only_with_p_standbys_no_dead_slot_formed_and_below_the_cap() -> None:
    state = ClusterState(generation=3, stages=2, pipelines=1)
    grown = plan_growth(state, [9, 7, 8], 7, max_pipelines=2, started=2)
    assert grown is not None
    new, slot = grown
    assert (new.generation, new.pipelines, new.grown, new.grown_at) == (4, 2, (7, 8), {"2": 4})
    assert slot == 2
    assert plan_growth(state, [9, 7, 8], 8, 2, 2)[1] == 3  # type: ignore[index]
    assert plan_growth(state, [9, 7, 8], 9, 2, 2) is None  # not one of the P chosen
    # a dead slot is filled first: no growth while one is
    assert plan_growth(ClusterState(3, 2, 1, dead=(1,)), [7, 8], 7, 2, 2) is None
    # no growth beyond the ticket's max_pipelines (0: the default, no growth at all)
    assert plan_growth(state, [7, 8], 7, 1, 2) is None
    assert plan_growth(state, [7, 8], 7, 0, 2) is None
    # fewer than P standbys queued; a worker of generation 0 not started yet; fatal
    assert plan_growth(state, [7], 7, 2, 2) is None
    assert plan_growth(state, [7, 8], 7, 2, 1) is None
    assert plan_growth(ClusterState(3, 2, 1, fatal="lost"), [7, 8], 7, 2, 2) is None
    # standbys the latest growth admitted do not count again
    after = ClusterState(4, 2, 2, grown=(7, 8), grown_at={"2": 4})
    assert plan_growth(after, [7, 8, 9], 9, 3, 2) is None
    assert plan_growth(after, [7, 9, 10], 9, 3, 2) is not None
    # a ticket of the same number issued after the growth is another learner's
    assert grown_slot(after, 8, Ticket("t", 3)) == 3
    assert grown_slot(after, 8, Ticket("t", 4)) is None


def test_a_growth_standby_gone_before_it_registered_is_named_for_the_watcher() -> None:
    """Standbys 7 and 8 were admitted into slots 2 and 3 (generation 4). A slot counts as
    lost only when neither its ``members/<slot>`` nor the standby's ``standbys/<w>`` is
    left (its lease ran out): the rendezvous would otherwise wait for it for ever."""
    state = ClusterState(4, 2, 2, grown=(7, 8), grown_at={"2": 4})
    members = frozenset({0, 1})
    assert lost_growth_joiners(state, members | {2}, frozenset({8})) == []  # both on their way
    assert lost_growth_joiners(state, members | {2}, frozenset()) == [3]
    assert lost_growth_joiners(state, members, frozenset()) == [2, 3]
    assert lost_growth_joiners(state.bump(dead=(3,)), members | {2}, frozenset()) == []
    assert lost_growth_joiners(ClusterState(4, 2, 1), members, frozenset()) == []
    # what the watcher passes: the view keeps the queued standbys from the watch
    view = ClusterView()
    view.apply([Change("standbys/7", {"since": 0}, 1), Change("standbys/8", {}, 2)], True)
    view.apply([Change("state", state.to_dict(), 3), Change("members/2", 2, 4)], False)
    view.apply([Change("standbys/7", None, 5, deleted=True)], False)
    seen = view.snapshot()
    assert seen.standbys == frozenset({8}) and seen.members == frozenset({2})
    view.apply([Change("standbys/8", None, 6, deleted=True)], False)
    seen = view.snapshot()
    assert seen.state is not None
    assert lost_growth_joiners(seen.state, seen.members | members, seen.standbys) == [3]


def test_a_lost_slot_is_filled_before_the_job_grows_and_tickets_stay_single_use(
    etcd_server: ManagedServer,
) -> None:
    """Slot 1 is dead and three standbys, whose tickets allow 2 pipelines, ask at once:
    one takes slot 1 (no growth while a slot is dead), then the other two grow the job,
    in a later generation. A used ticket and an unknown token are refused afterwards."""
    store = _formed(etcd_server)
    job = store.prefix.rstrip("/").split("/")[-2]
    try:
        state, token = store.get_state()
        assert state is not None
        assert store.set_state(state.bump(dead=(1,), lost_at={"1": 1}), token)
        for candidate in (5, 6, 7):
            issue_ticket(store, candidate, f"t{candidate}", max_pipelines=2)
        waits = {c: _admit_in_thread(etcd_server, job, c, f"t{c}") for c in (5, 6, 7)}
        slots = {c: _result(got) for c, got in waits.items()}
        assert sorted(slots.values()) == [1, 2, 3]
        state, _ = store.get_state()
        assert state is not None
        assert (state.pipelines, state.dead) == (2, ())
        filled = next(c for c, slot in slots.items() if slot == 1)
        assert state.joined_at == {"1": 2}  # the lost slot first (generation 2) ...
        assert state.grown_at == {"2": 3}  # ... then the growth (generation 3)
        assert sorted(state.grown) == sorted({5, 6, 7} - {filled})
        for candidate, slot in slots.items():
            ticket = store.get(f"tickets/{candidate}")
            assert ticket is not None and ticket["slot"] == slot
            assert ticket["used_at"] == (2 if slot == 1 else 3)
        grower = state.grown[0]
        with pytest.raises(Refused, match="joins once"):
            admit(store, grower, f"t{grower}", ttl_s=5, log=lambda _m: None)
        with pytest.raises(Refused, match="stale or unknown"):
            admit(store, state.grown[1], "wrong", ttl_s=5, log=lambda _m: None)
        # a slot of the new pipeline is lost; a standby takes it; the replacement issued
        # for that first loss arrives only after the slot is lost again: stale
        lose(store, 3)
        old = issue_ticket(store, 3, "first-loss")
        issue_ticket(store, 9, "t9")
        assert _result(_admit_in_thread(etcd_server, job, 9, "t9")) == 3
        lose(store, 3)
        store.put("tickets/3", old.to_dict())
        with pytest.raises(Refused, match="stale generation"):
            admit(store, 3, "first-loss", ttl_s=5, log=lambda _m: None)
    finally:
        for view in VIEWS:
            view.close()
        VIEWS.clear()
        store.delete_all()
        store.close()
