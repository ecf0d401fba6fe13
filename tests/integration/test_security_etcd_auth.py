"""etcd with authentication (contract/etcd.py `enable_auth`, `EtcdCredentials`), against a
real etcd of its own (authentication would lock the shared one's other users out)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from contract import etcd_keys
from contract.etcd import EtcdAuthError, EtcdClient, EtcdCredentials
from contract.etcd_users import enable_auth
from services.embedded.servers import EtcdServer
from tests.etcd_auth import PLATFORM, ROOT

pytestmark = pytest.mark.integration


def test_an_unauthenticated_client_is_refused_naming_why(etcd_with_auth: str) -> None:
    client = EtcdClient(etcd_with_auth)
    try:
        with pytest.raises(EtcdAuthError, match="requires authentication"):
            client.put(etcd_keys.control("job-x"), {"action": "halt"})
        with pytest.raises(EtcdAuthError):
            client.get(etcd_keys.control("job-x"))
    finally:
        client.close()


def test_a_wrong_password_is_refused_without_printing_it(etcd_with_auth: str) -> None:
    wrong = EtcdCredentials("rhizome", "not-the-password")
    with pytest.raises(EtcdAuthError, match="refused user 'rhizome'") as err:
        EtcdClient(etcd_with_auth, credentials=wrong)
    assert "not-the-password" not in str(err.value)
    assert "not-the-password" not in repr(wrong)


def test_the_platform_user_works_under_its_prefix_only(etcd_with_auth: str) -> None:
    client = EtcdClient.connect(etcd_with_auth, credentials=PLATFORM)
    try:
        key = etcd_keys.control("job-y")
        client.put(key, {"action": "halt"})
        assert client.get(key) is not None
        with pytest.raises(EtcdAuthError):
            client.put("/elsewhere/key", 1)
    finally:
        client.close()


def test_enable_auth_again_leaves_it_as_it_is(etcd_with_auth: str) -> None:
    enable_auth(etcd_with_auth, ROOT, PLATFORM, etcd_keys.ROOT + "/")
    client = EtcdClient.connect(etcd_with_auth, credentials=PLATFORM)
    client.close()


def test_credentials_file_round_trip_is_0600_and_refuses_a_readable_file(tmp_path: Path) -> None:
    path = tmp_path / "etcd-rhizome.secret"
    PLATFORM.write(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert EtcdCredentials.from_file(path) == PLATFORM
    path.chmod(0o644)
    with pytest.raises(ValueError, match=f"chmod 600 {path}"):
        EtcdCredentials.from_file(path)


class ShortTokenEtcd(EtcdServer):
    """etcd whose simple auth tokens lapse after one idle second (default 300 s)."""

    def argv(self) -> list[str]:
        return [*super().argv(), "--auth-token-ttl=1"]


def test_an_expired_auth_token_is_renewed_and_the_call_retried(tmp_path: Path) -> None:
    import time

    import grpc

    server = ShortTokenEtcd(tmp_path)
    server.start()
    try:
        enable_auth(server.url, ROOT, PLATFORM, etcd_keys.ROOT + "/")
        client = EtcdClient.connect(server.url, credentials=PLATFORM)
        key = etcd_keys.control("job-expiry")
        client.put(key, {"action": "halt"})
        # Wait until etcd has forgotten the client's token: the library's own call, which
        # does not re-authenticate, is refused with etcd's "invalid auth token".
        deadline = time.monotonic() + 60
        while True:
            time.sleep(2.5)  # longer than the TTL: a successful probe renews the token
            try:
                client.raw.get(key)
            except grpc.RpcError as exc:
                assert "invalid auth token" in str(exc.details()), exc
                break
            assert time.monotonic() < deadline, "etcd never expired the auth token"
        assert client.reauthentications == 0
        entry = client.get(key)
        assert entry is not None and entry.value == {"action": "halt"}
        assert client.reauthentications == 1
        client.put(key, {"action": "resume"})  # the new token serves later calls too
        client.close()
    finally:
        server.stop()


def test_a_job_user_reaches_its_own_jobs_keys_only_and_is_removed(etcd_with_auth: str) -> None:
    from contract.etcd_users import add_job_user, remove_job_user

    mine = add_job_user(etcd_with_auth, ROOT, "job-a")
    add_job_user(etcd_with_auth, ROOT, "job-b")
    client = EtcdClient.connect(etcd_with_auth, credentials=mine)
    try:
        status = etcd_keys.learner_status("job-a", 0)
        client.put(status, {"status": "PROCESSING"})
        assert client.get(status) is not None
        # Another job's keys, the platform's own keys: refused, read and write.
        with pytest.raises(EtcdAuthError):
            client.get(etcd_keys.learner_status("job-b", 0))
        with pytest.raises(EtcdAuthError):
            client.put(etcd_keys.control("job-b"), {"action": "halt"})
        with pytest.raises(EtcdAuthError):
            client.get(etcd_keys.leader("lcm"))
    finally:
        client.close()
    remove_job_user(etcd_with_auth, ROOT, "job-a")
    remove_job_user(etcd_with_auth, ROOT, "job-a")  # again: nothing to do
    with pytest.raises(EtcdAuthError, match="refused user 'rhizome-job-job-a'"):
        EtcdClient(etcd_with_auth, credentials=mine)


def test_calls_racing_auth_changes_are_retried_not_failed(etcd_with_auth: str) -> None:
    """Every job's etcd user is added and removed by the LCM while other clients' calls
    are in flight; etcd refuses a call whose auth revision an auth change overtook
    between its check and its apply ("revision of auth store is old"). Jobs failed their
    deploys with it under load (benchmarks/control_plane_scale.py). The client retries
    such a call with a fresh token, as etcd's own Go client does: none fails here."""
    import threading
    import time

    from contract.etcd_users import add_job_user, remove_job_user

    stop = threading.Event()
    changes = 0

    def churn() -> None:
        nonlocal changes
        while not stop.is_set():
            add_job_user(etcd_with_auth, ROOT, f"job-churn-{changes % 3}")
            remove_job_user(etcd_with_auth, ROOT, f"job-churn-{changes % 3}")
            changes += 1

    client = EtcdClient.connect(etcd_with_auth, credentials=PLATFORM)
    churner = threading.Thread(target=churn)
    churner.start()
    try:
        key = etcd_keys.control("job-revision")
        deadline = time.monotonic() + 60
        i = 0
        while changes < 12:  # each change hashes a password in etcd: tens of ms
            assert time.monotonic() < deadline, f"only {changes} auth changes in 60 s"
            client.put(key, {"n": i})
            entry = client.get(key)
            assert entry is not None and entry.value == {"n": i}
            i += 1
    finally:
        stop.set()
        churner.join()
        client.close()
