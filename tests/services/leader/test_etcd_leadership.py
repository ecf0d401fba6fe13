"""Leadership by an etcd key under a lease, against a real etcd: one holder at a time,
a resign or a dead local holder hands the role on at once, and every term's fencing
token is larger than the last."""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid

import pytest

from contract import etcd_keys, procs
from contract.etcd import EtcdClient
from services.embedded.process import ManagedServer
from services.leader.api import NotLeader
from services.leader.etcd import EtcdLeadership
from tests.services.guardian.helpers import wait_for

pytestmark = pytest.mark.integration


def _campaign(leadership: EtcdLeadership) -> tuple[threading.Event, threading.Event]:
    elected, lost = threading.Event(), threading.Event()
    leadership.campaign(elected.set, lost.set)
    return elected, lost


def test_one_holder_at_a_time_and_a_resign_hands_the_role_on(
    etcd_server: ManagedServer,
) -> None:
    etcd = EtcdClient.connect(etcd_server.url)
    role = f"test/{uuid.uuid4().hex[:8]}"
    first = EtcdLeadership(etcd, role, info={"name": "first"})
    second = EtcdLeadership(etcd, role, info={"name": "second"})
    try:
        first_elected, _ = _campaign(first)
        wait_for("the first to lead", first_elected.is_set, timeout_s=10)
        second_elected, _ = _campaign(second)
        # The second reads the key several times (every 0.25 s) while the first holds it.
        assert not second_elected.wait(1.0)
        with pytest.raises(NotLeader):
            second.token()
        holder = second.holder()
        assert holder is not None and holder["name"] == "first"
        first_term = first.token()
        first.resign()
        wait_for("the second to lead", second_elected.is_set, timeout_s=10)
        assert second.token() > first_term
    finally:
        first.resign()
        second.resign()
        etcd.close()


def test_a_dead_holder_on_this_host_is_replaced_without_waiting_out_its_lease(
    etcd_server: ManagedServer,
) -> None:
    etcd = EtcdClient.connect(etcd_server.url)
    role = f"test/{uuid.uuid4().hex[:8]}"
    # A holder that is gone: a process that ran and exited, its key under a long lease.
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    pid = int(gone.stdout)
    assert not procs.pid_alive(pid)
    lease = etcd.grant(600)
    import socket

    etcd.create(
        etcd_keys.leader(role), {"pid": pid, "start": 1, "host": socket.gethostname()}, lease
    )
    contender = EtcdLeadership(etcd, role)
    try:
        elected, _ = _campaign(contender)
        # Well inside the 600 s lease: the contender saw the holder's process was gone.
        wait_for("the contender to lead", elected.is_set, timeout_s=10)
        entry = etcd.get(etcd_keys.leader(role))
        assert entry is not None and entry.value["pid"] != pid
    finally:
        contender.resign()
        etcd.close()


def test_a_holder_on_another_host_is_waited_for(etcd_server: ManagedServer) -> None:
    etcd = EtcdClient.connect(etcd_server.url)
    role = f"test/{uuid.uuid4().hex[:8]}"
    lease = etcd.grant(600)
    etcd.create(
        etcd_keys.leader(role), {"pid": 1, "start": 1, "host": "another-host.invalid"}, lease
    )
    contender = EtcdLeadership(etcd, role)
    try:
        elected, _ = _campaign(contender)
        assert not elected.wait(1.0)  # its liveness is not ours to judge: its lease decides
        etcd.revoke(lease.id)
        wait_for("the contender to lead once the lease is gone", elected.is_set, timeout_s=10)
    finally:
        contender.resign()
        etcd.close()
