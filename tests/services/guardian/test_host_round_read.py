"""A settled hosted guardian's safety round reads etcd in one call (issue #18: its four
reads a round were the host's own largest steady cost per alive job): the control key,
the learners' statuses and the restart and preemption counts in one transaction
(`EtcdClient.get_many`), fresh from etcd. Its backend calls that cannot block (the local
backend's `start_helper` and `controller_alive`) run in the step's thread, not on the
TimedBackend's pool. So the round is still the net behind the
watch: with the host's watch gone, a delete on the control key reaches the job through
it alone. Real etcd and MongoDB-wire server, the local backend, the host in this
process."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from contract import etcd_keys
from contract.etcd import EtcdClient
from contract.status import ExitCode
from services.backends.api import TimedBackend
from services.backends.local.backend import LocalBackend
from services.guardian.host import HostedGuardian
from services.store import states
from tests.services.guardian.helpers import job_report, running_host, submit, wait_for

pytestmark = pytest.mark.integration

POLL_S = 0.2
SAFETY_POLL_S = 1.0
READS = ("get", "get_prefix", "get_many")


class _CountingEtcd:
    """The host's etcd client as one guardian sees it, counting its reads."""

    def __init__(self, etcd: EtcdClient, counts: Counter[str]) -> None:
        self._etcd = etcd
        self._counts = counts

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._etcd, name)
        if name not in READS:
            return attribute

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._counts[name] += 1
            return attribute(*args, **kwargs)

        return counted


class _Counted(HostedGuardian):
    """Counts its steps and its etcd reads (from its first monitoring round on)."""

    steps = 0
    reads: Counter[str] = Counter()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.etcd = _CountingEtcd(self.etcd, _Counted.reads)  # type: ignore[assignment]

    def step(self) -> int | None:
        _Counted.steps += 1
        return super().step()


def processing(stores: dict[str, Any], job_id: str) -> bool:
    entry = stores["etcd"].get(etcd_keys.learner_status(job_id, 0))
    return isinstance(entry and entry.value, dict) and entry.value.get("status") == "PROCESSING"


def test_a_settled_guardian_s_safety_round_is_one_etcd_call_no_thread_hop_and_the_net_behind_the_watch(
    stores: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("services.guardian.host.HostedGuardian", _Counted)
    _Counted.steps = 0
    _Counted.reads.clear()
    job_id = submit(stores["repo"], tmp_path, "sleep 120").job_id

    def report() -> str:
        return job_report(stores["repo"], job_id, tmp_path)

    # Its settled guardian steps every SAFETY_POLL_S without a change; every job it still
    # guards is deleted at the end (its safety round sees that without the watch).
    with running_host(
        stores,
        tmp_path,
        LocalBackend(),
        poll_s=POLL_S,
        safety_poll_s=SAFETY_POLL_S,
        host_id="round-read",
    ) as (host, ended):
        assert host.adopt(job_id)
        wait_for("learner 0 PROCESSING", lambda: processing(stores, job_id), explain=report)
        hosted = host.guardians[job_id]
        guardian = hosted.guardian
        assert isinstance(guardian, _Counted)
        wait_for(
            "its guardian settled",
            lambda: guardian.idle_s(host.config) == SAFETY_POLL_S and not hosted.running,
        )
        # The watch is lost: from here on only the safety round steps the guardian.
        assert host._watch is not None
        host._watch.stop()
        time.sleep(3 * POLL_S)  # a step the watch started before it stopped has ended
        wait_for("no step running", lambda: not hosted.running)
        # A backend call made on TimedBackend's pool is a hop to another thread and back.
        assert isinstance(host.backend, TimedBackend)
        pool = host.backend._pool
        hops: list[str] = []
        submit_to_pool = pool.submit

        def counted_submit(call: Any, *args: Any, **kwargs: Any) -> Any:
            hops.append(call.__name__)
            return submit_to_pool(call, *args, **kwargs)

        monkeypatch.setattr(pool, "submit", counted_submit)
        steps = _Counted.steps
        _Counted.reads.clear()  # the counter the guardian holds
        wait_for("two safety rounds", lambda: _Counted.steps >= steps + 2 and not hosted.running)
        rounds = _Counted.steps - steps
        # one transaction of reads a round; before: a get each of the control key and
        # the two counts, and a get_prefix of the learners' statuses
        assert dict(_Counted.reads) == {"get_many": rounds}, (rounds, _Counted.reads)
        # the local backend's start_helper (nothing to start) and controller_alive (a /proc
        # read) run in the step's thread; before: both on the pool, two hops a round
        assert hops == [], (rounds, hops)
        assert stores["repo"].get(job_id).status == states.PROCESSING

        # A delete that no watch delivers: the next safety round reads it and ends the job.
        stores["etcd"].put(etcd_keys.control(job_id), {"action": "delete", "reason": "test"})
        wait_for(
            "the job DELETED by a safety round",
            lambda: stores["repo"].get(job_id).status == states.DELETED,
            explain=report,
        )
        wait_for("its guardian ended", lambda: not host.guardians)
        assert host.ended == {job_id: 0}
    assert ended == [ExitCode.OK], report()


def test_get_many_reads_keys_and_prefixes_in_one_call_as_get_and_get_prefix_do(
    stores: dict[str, Any],
) -> None:
    etcd: EtcdClient = stores["etcd"]
    job = "job-get-many"
    lease = etcd.grant(30)
    try:
        etcd.put(etcd_keys.control(job), {"action": "halt"})
        etcd.put(etcd_keys.learner_status(job, 0), {"status": "PROCESSING"}, lease=lease)
        etcd.put(etcd_keys.learner_status(job, 1), {"status": "STARTING"})
        etcd.put(etcd_keys.deploy_step(job, "complete"), {"generation": 1})  # not asked for
        absent = etcd_keys.deploy_step(job, "restarts")
        prefix = etcd_keys.learner_prefix(job)
        read = etcd.get_many(keys=(etcd_keys.control(job), absent), prefixes=(prefix,))
        expected = {etcd_keys.control(job): etcd.get(etcd_keys.control(job))}
        expected.update(etcd.get_prefix(prefix))
        assert read == expected  # values, mod revisions and leases alike
        assert read[etcd_keys.learner_status(job, 0)].lease == lease.id
        assert absent not in read
        assert etcd.get_many() == {}
    finally:
        lease.revoke()
        etcd.delete_prefix(etcd_keys.job_prefix(job))
