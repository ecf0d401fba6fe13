"""The LCM's job set-ups in batches (services/lcm/setup.py `JobSetups`, and the
LifecycleManager giving a job out when its set-up ends), against a real etcd with
authentication of its own (authentication would lock the shared one's other users out)
and the session's MongoDB-wire server."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from contract import etcd_keys
from contract.etcd import EtcdAuthError, EtcdClient, EtcdCredentials
from contract.etcd_users import JobUsers, job_etcd_password, job_etcd_user
from services.lcm.manager import LcmConfig, LifecycleManager
from services.lcm.setup import JobSetups
from services.security.api import JOB_ETCD_CREDENTIALS_ENV, JOB_TOKEN_ENV
from tests.etcd_auth import PLATFORM, ROOT
from tests.services.guardian.helpers import wait_for

pytestmark = pytest.mark.integration

# A job id etcd refuses as a role name: over the request size its gRPC server takes.
REFUSED = "job-" + "x" * (2 * 2**20)


@pytest.fixture(scope="module")
def etcd_url(etcd_with_auth: str) -> str:
    return etcd_with_auth


def _token(job_id: str) -> dict[str, str] | None:
    return {JOB_TOKEN_ENV: f"token-of-{job_id}"}


def _password(job_id: str) -> str:
    return job_etcd_password(ROOT, job_id)


def _user_works_on_its_own_keys_only(url: str, env: dict[str, str], job_id: str) -> None:
    credentials = EtcdCredentials.parse(env[JOB_ETCD_CREDENTIALS_ENV])
    assert credentials.user == job_etcd_user(job_id)
    client = EtcdClient.connect(url, credentials=credentials)
    try:
        client.put(etcd_keys.learner_status(job_id, 0), {"status": "PROCESSING"})
        assert client.get(etcd_keys.learner_status(job_id, 0)) is not None
        with pytest.raises(EtcdAuthError):  # another job's keys
            client.get(etcd_keys.learner_status(f"other-than-{job_id}", 0))
        with pytest.raises(EtcdAuthError):  # the platform's
            client.get(etcd_keys.leader("lcm"))
    finally:
        client.close()


def _authenticates(url: str, job_id: str) -> bool:
    try:
        EtcdClient(
            url, credentials=EtcdCredentials(job_etcd_user(job_id), _password(job_id))
        ).close()
    except EtcdAuthError:
        return False
    return True


def test_set_ups_asked_together_are_one_batch_and_each_job_gets_its_own_user(
    etcd_url: str,
) -> None:
    jobs = [f"job-together-{i}" for i in range(8)]
    with JobUsers(etcd_url, ROOT) as users:
        setups = JobSetups(users, _password, _token, start=False)
        futures = [setups.submit(j) for j in jobs]
        setups.start()
        envs = [f.result(timeout=60) for f in futures]
        setups.close()
        assert setups.stats.batches == 1 and setups.stats.largest == len(jobs)
        assert users.clients == 1 and users.changes == 4 * len(jobs)
    for job_id, env in zip(jobs, envs, strict=True):
        assert env is not None and env[JOB_TOKEN_ENV] == f"token-of-{job_id}"
        _user_works_on_its_own_keys_only(etcd_url, env, job_id)


def test_set_ups_asked_from_many_threads_each_get_a_working_user(etcd_url: str) -> None:
    jobs = [f"job-threads-{i}" for i in range(12)]
    envs: dict[str, dict[str, str] | None] = {}
    with JobUsers(etcd_url, ROOT) as users:
        setups = JobSetups(users, _password, _token, max_batch=5)

        def ask(job_id: str) -> None:
            envs[job_id] = setups.submit(job_id).result(timeout=60)

        threads = [threading.Thread(target=ask, args=(j,)) for j in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        setups.close()
        assert setups.stats.largest <= 5  # no batch over max_batch
    for job_id in jobs:
        env = envs[job_id]
        assert env is not None
        _user_works_on_its_own_keys_only(etcd_url, env, job_id)


def test_a_set_up_that_fails_fails_only_its_own_job_naming_why(
    etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    def rest(job_id: str) -> dict[str, str] | None:
        if job_id == "job-no-cert":  # as the LCM's own, when a certificate cannot be issued
            raise RuntimeError("the CA is unreadable")
        return _token(job_id)

    jobs = ["job-ok-1", REFUSED, "job-no-cert", "job-ok-2"]
    caplog.set_level(logging.INFO, logger="rhizome.lcm")
    with JobUsers(etcd_url, ROOT) as users:
        setups = JobSetups(users, _password, rest, start=False)
        futures = [setups.submit(j) for j in jobs]
        setups.start()
        envs = [f.result(timeout=60) for f in futures]
        setups.close()
        assert setups.stats.failed == 2
    assert envs[1] is None and envs[2] is None
    for job_id, env in ((jobs[0], envs[0]), (jobs[3], envs[3])):
        assert env is not None
        _user_works_on_its_own_keys_only(etcd_url, env, job_id)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(
        "cannot make its etcd user" in m and "refused to add etcd role" in m for m in errors
    ), errors
    assert any("job job-no-cert: its set-up failed" in m for m in errors), errors


def test_removals_and_set_ups_are_made_in_the_order_asked(etcd_url: str) -> None:
    with JobUsers(etcd_url, ROOT) as users:
        setups = JobSetups(users, _password, _token)
        assert setups.submit("job-order-a").result(timeout=60) is not None
        assert setups.submit("job-order-b").result(timeout=60) is not None
        assert _authenticates(etcd_url, "job-order-a")
        setups.close()  # both removals and the set-up below in one batch, in this order
        setups = JobSetups(users, _password, _token, start=False)
        setups.remove("job-order-a")  # a job that ended...
        setups.remove("job-order-b")  # ...and one halted and resumed at once
        again = setups.submit("job-order-b")
        setups.start()
        assert again.result(timeout=60) is not None
        setups.close()  # makes the removals asked for before it returns
        assert setups.stats.removals == 2 and setups.stats.batches == 1
    assert not _authenticates(etcd_url, "job-order-a")
    assert _authenticates(etcd_url, "job-order-b")


@pytest.fixture
def lcm(stores: dict[str, Any], etcd_url: str, tmp_path: Path) -> Iterator[LifecycleManager]:
    """An LCM (not started: no rounds) whose etcd requires authentication."""
    config = LcmConfig(
        tmp_path,
        etcd_url,
        stores["mongo_url"],
        etcd_root=ROOT,
        job_token=lambda job_id: f"token-of-{job_id}",
        guardians_per_host=100,
    )
    etcd = EtcdClient.connect(etcd_url, credentials=PLATFORM)
    manager = LifecycleManager(config, stores["repo"], etcd)
    yield manager
    manager._setup.close()
    if manager._users is not None:
        manager._users.close()
    etcd.close()


def test_the_lcm_gives_each_job_out_once_its_user_exists_and_removes_it_when_it_ends(
    lcm: LifecycleManager, etcd_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    given: dict[str, dict[str, str]] = {}

    def give(job_id: str, env: dict[str, str]) -> None:  # a host's assignment line
        assert _authenticates(etcd_url, job_id)  # its user exists before it is given out
        given[job_id] = env

    monkeypatch.setattr(lcm, "_give", give)
    jobs = [f"job-lcm-{i}" for i in range(6)]
    with lcm._lock:  # as a round does: every waiting job asked for at once
        for job_id in [*jobs, REFUSED]:
            lcm.assign(job_id)
    wait_for("set-ups", lambda: not lcm._setups, timeout_s=60)
    assert sorted(given) == sorted(jobs)  # given out by the set-up's end, no round ran
    for job_id in jobs:
        _user_works_on_its_own_keys_only(etcd_url, given[job_id], job_id)
        assert given[job_id][JOB_TOKEN_ENV] == f"token-of-{job_id}"
    # the refused one is not given out; the next rounds ask again after a pause
    assert REFUSED not in given and lcm.not_before.get(REFUSED, 0.0) > 0.0
    # The jobs ended (not in the store: deleted): their users are removed, in a batch.
    for job_id in jobs[:3]:
        lcm._job_ended(job_id)
    wait_for("removals", lambda: lcm._setup.stats.removals == 3, timeout_s=60)
    for job_id in jobs:
        assert _authenticates(etcd_url, job_id) is (job_id not in jobs[:3])


def test_a_job_queued_behind_others_in_a_busy_host_is_not_given_out_again(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    """A host takes its assignments one at a time; a burst of set-ups queues hundreds.
    A job it has not come to yet is waited for (host_adopt_backlog_s), not given out
    again after the short grace; one it passed over (it took a job given after it), or
    took and let go of, is given out again."""
    from types import SimpleNamespace

    from contract import procs
    from services.lcm.manager import GuardianHostProcess, Supervised

    config = LcmConfig(tmp_path, stores["etcd_url"], stores["mongo_url"], host_adopt_grace_s=0.0)
    lcm = LifecycleManager(config, stores["repo"], stores["etcd"])
    try:
        me = procs.ProcRef.of(os.getpid())
        assert me is not None
        host = GuardianHostProcess("host-a", None, me, {"job-1", "job-2"})
        given = time.monotonic()
        first = Supervised("job-1", me, child=False, host=host, started=given - 10.0)
        later = Supervised("job-2", me, child=False, host=host, started=given - 5.0)
        assert lcm._guards(first, None) and lcm._guards(later, None)  # not come to yet
        taken = SimpleNamespace(value={"pid": me.pid, "host": "host-a"})
        assert lcm._guards(later, taken)  # it took job-2, given after job-1...
        assert not lcm._guards(first, None)  # ...so it passed job-1 over: out again
        assert host.jobs == {"job-2"}
        assert not lcm._guards(later, None)  # taken, then let go of: not waited for
    finally:
        lcm._setup.close()


def test_no_more_than_the_start_window_of_hosted_jobs_is_started_at_once(
    stores: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of placed jobs is started `hosted_start_window` at a time: the next ones
    are set up and given out only as earlier ones reach PROCESSING (or end)."""
    import uuid

    from contract import procs
    from services.lcm.manager import GuardianHostProcess, Supervised
    from services.store import states
    from services.store.jobs import JobsRepository
    from services.store.mongo import connect
    from tests.services.guardian.helpers import submit

    # A database of its own: the round looks at every active job in it.
    repo = JobsRepository(connect(stores["mongo_url"], f"start_window_{uuid.uuid4().hex[:8]}"))
    repo.ensure_indexes()
    config = LcmConfig(
        tmp_path,
        stores["etcd_url"],
        stores["mongo_url"],
        guardians_per_host=10,
        hosted_start_window=2,
    )
    lcm = LifecycleManager(config, repo, stores["etcd"])
    me = procs.ProcRef.of(os.getpid())
    assert me is not None
    host = GuardianHostProcess("host-w", None, me, set())
    given: list[str] = []

    def give(job_id: str, env: dict[str, str]) -> None:  # as a host that takes its time
        given.append(job_id)
        host.jobs.add(job_id)
        lcm.guardians[job_id] = Supervised(job_id, me, child=False, host=host)

    monkeypatch.setattr(lcm, "_give", give)

    def round_() -> None:
        lcm.reconcile()
        wait_for("the round's set-ups", lambda: not lcm._setups, timeout_s=60)

    try:
        jobs = [submit(repo, tmp_path, "true").job_id for _ in range(5)]
        round_()
        assert len(given) == 2 and set(given) <= set(jobs)
        round_()  # both still starting: nothing more
        assert len(given) == 2
        repo.transition(given[0], states.DEPLOYING, "deploying")
        round_()  # deploying is still starting
        assert len(given) == 2
        repo.transition(given[0], states.PROCESSING, "running")
        round_()  # one of them runs: one more is started
        assert len(given) == 3
        repo.transition(given[1], states.FAILED, "ended")
        repo.transition(given[2], states.DEPLOYING, "deploying")
        round_()  # one ended, the third still starting: one more
        assert len(given) == 4
        assert len(set(given)) == 4 and set(given) <= set(jobs)
    finally:
        lcm._setup.close()
