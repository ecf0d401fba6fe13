"""Jobs' etcd users made and removed in batches by one long-lived root client
(contract/etcd.py `JobUsers`), against a real etcd with authentication of its own
(authentication would lock the shared one's other users out)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from contract import etcd_keys
from contract.etcd import EtcdAuthError, EtcdClient, EtcdCredentials, StoreUnavailable
from contract.etcd_users import JobUserChange, JobUsers, enable_auth, job_etcd_user
from contract.procs import free_port
from services.embedded.servers import EtcdServer
from tests.etcd_auth import PLATFORM, ROOT

pytestmark = pytest.mark.integration


@pytest.fixture
def users(etcd_with_auth: str) -> Iterator[JobUsers]:
    with JobUsers(etcd_with_auth, ROOT) as job_users:
        yield job_users


def _password(job_id: str) -> str:
    return f"pw-{job_id}-{os.urandom(4).hex()}"


def _reaches_only_its_own_keys(
    url: str, credentials: EtcdCredentials, job_id: str, other: str
) -> None:
    client = EtcdClient.connect(url, credentials=credentials)
    try:
        key = etcd_keys.learner_status(job_id, 0)
        client.put(key, {"status": "PROCESSING"})
        entry = client.get(key)
        assert entry is not None and entry.value == {"status": "PROCESSING"}
        with pytest.raises(EtcdAuthError):  # another job's keys
            client.get(etcd_keys.learner_status(other, 0))
        with pytest.raises(EtcdAuthError):
            client.put(etcd_keys.control(other), {"action": "halt"})
        with pytest.raises(EtcdAuthError):  # the platform's own keys
            client.get(etcd_keys.leader("lcm"))
    finally:
        client.close()


def _names(url: str) -> tuple[set[str], set[str]]:
    """etcd's users and roles, as its root sees them."""
    from pyetcd import etcdrpc

    client = EtcdClient(url, credentials=ROOT)
    try:
        raw, meta = client.raw, {"metadata": client.raw.metadata}
        users = raw.authstub.UserList(etcdrpc.AuthUserListRequest(), 5.0, **meta).users
        roles = raw.authstub.RoleList(etcdrpc.AuthRoleListRequest(), 5.0, **meta).roles
        return set(users), set(roles)
    finally:
        client.close()


def test_a_batch_gives_every_job_a_user_confined_to_its_own_keys(
    etcd_with_auth: str, users: JobUsers
) -> None:
    jobs = [f"job-batch-{i}" for i in range(6)]
    outcomes = users.apply([JobUserChange(j, _password(j)) for j in jobs])
    assert [o.job_id for o in outcomes] == jobs
    assert all(o.error is None and o.credentials is not None for o in outcomes)
    # one root client (one authentication) for the whole batch; four changes a job
    assert users.clients == 1
    assert users.changes == 4 * len(jobs)
    for i, outcome in enumerate(outcomes):
        assert outcome.credentials is not None
        assert outcome.credentials.user == job_etcd_user(jobs[i])
        other = jobs[(i + 1) % len(jobs)]
        _reaches_only_its_own_keys(etcd_with_auth, outcome.credentials, jobs[i], other)


def test_a_change_etcd_refuses_fails_its_own_job_only(etcd_with_auth: str, users: JobUsers) -> None:
    # A job id etcd cannot take as a role name: its request is over the size
    # its gRPC server takes (2 MiB), an answer of etcd's own about this job alone.
    huge = "job-" + "x" * (2 * 2**20)
    first, second = "job-fine-1", "job-fine-2"
    outcomes = users.apply(
        [
            JobUserChange(first, _password(first)),
            JobUserChange(huge, _password(huge)),
            JobUserChange(second, _password(second)),
        ]
    )
    assert outcomes[0].error is None and outcomes[2].error is None
    error = outcomes[1].error
    assert isinstance(error, StoreUnavailable) and outcomes[1].credentials is None
    # it names the change that failed and etcd's answer, not "unreachable"
    assert "refused to add etcd role rhizome-job-job-xxx" in str(error)
    assert "unreachable" not in str(error)
    assert len(str(error)) < 1000  # the name is cut, not printed whole
    for job_id, outcome in ((first, outcomes[0]), (second, outcomes[2])):
        assert outcome.credentials is not None
        _reaches_only_its_own_keys(etcd_with_auth, outcome.credentials, job_id, huge[:20])


def test_removal_in_a_batch_with_adds_deletes_the_user_and_its_role(
    etcd_with_auth: str, users: JobUsers
) -> None:
    a, b, c = "job-rm-a", "job-rm-b", "job-rm-c"
    made = users.apply([JobUserChange(a, _password(a)), JobUserChange(b, _password(b))])
    creds_a = made[0].credentials
    assert creds_a is not None and made[1].credentials is not None
    EtcdClient.connect(etcd_with_auth, credentials=creds_a).close()  # it works now
    # removals and an add in one batch, in their order
    outcomes = users.apply([JobUserChange(a), JobUserChange(c, _password(c)), JobUserChange(b)])
    assert [o.error for o in outcomes] == [None, None, None]
    assert outcomes[0].credentials is None and outcomes[2].credentials is None
    known_users, known_roles = _names(etcd_with_auth)
    for gone in (a, b):
        assert job_etcd_user(gone) not in known_users
        assert job_etcd_user(gone) not in known_roles
    assert job_etcd_user(c) in known_users and job_etcd_user(c) in known_roles
    with pytest.raises(EtcdAuthError):
        EtcdClient(etcd_with_auth, credentials=creds_a)
    # removed again: nothing to do, no error; and a removed job can be set up again
    users.remove(a)
    again = users.add(a, _password(a))
    _reaches_only_its_own_keys(etcd_with_auth, again, a, c)


def test_the_same_job_set_up_again_takes_the_new_password(
    etcd_with_auth: str, users: JobUsers
) -> None:
    job = "job-again"
    old = users.add(job, _password(job))
    new = users.add(job, _password(job))
    EtcdClient.connect(etcd_with_auth, credentials=new).close()
    with pytest.raises(EtcdAuthError):
        EtcdClient(etcd_with_auth, credentials=old)


def test_an_unreachable_etcd_fails_every_change_of_the_batch_naming_it() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with JobUsers(url, ROOT, timeout_s=0.5) as users:
        outcomes = users.apply([JobUserChange(f"job-u-{i}", "pw") for i in range(3)])
    assert all(isinstance(o.error, StoreUnavailable) for o in outcomes)
    assert all("rhizome-job-job-u-" in str(o.error) and url in str(o.error) for o in outcomes)


class ShortTokenEtcd(EtcdServer):
    """etcd whose simple auth tokens lapse after one idle second (default 300 s)."""

    def argv(self) -> list[str]:
        return [*super().argv(), "--auth-token-ttl=1"]


def test_the_long_lived_root_client_re_authenticates_when_its_token_lapsed(
    tmp_path: Path,
) -> None:
    server = ShortTokenEtcd(tmp_path)
    server.start()
    try:
        enable_auth(server.url, ROOT, PLATFORM, etcd_keys.ROOT + "/")
        with JobUsers(server.url, ROOT) as users:
            users.add("job-t-1", _password("job-t-1"))
            time.sleep(2.5)  # past the token's TTL: etcd forgot the root client's token
            made = users.add("job-t-2", _password("job-t-2"))
            users.remove("job-t-1")
            assert users.clients == 1  # the same client, with a new token
            assert users._client is not None and users._client.reauthentications >= 1
        _reaches_only_its_own_keys(server.url, made, "job-t-2", "job-t-1")
    finally:
        server.stop()
