"""The runtime's process groups listen on the worker's own address, never on every
interface (issue #15): read back from the kernel's socket table."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch.distributed as dist

from learner.runtime.comm import make_group, route_address


def listening_sockets() -> set[tuple[str, str]]:
    """(socket inode, local address in hex as /proc/net/tcp* writes it) of this process's
    listeners."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as fh:
            for row in fh.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    found.add((cols[9], cols[1].rsplit(":", 1)[0]))
    return found


# 127.0.0.2, little-endian hex: a loopback address of its own, so that the group's
# default (the host name's address, often 127.0.0.1) cannot pass for the one asked for.
ASKED = "0200007F"


def test_route_address_is_loopback_for_a_local_rendezvous() -> None:
    assert route_address("127.0.0.1") == "127.0.0.1"
    assert route_address("localhost") in ("127.0.0.1", "::1")


def test_gloo_groups_listen_on_the_given_address_only() -> None:
    # Other tests of the session may have left listeners in this process (servers hosted
    # in-process): only the sockets the groups opened are the groups'.
    before = listening_sockets()
    store = dist.HashStore()
    groups: dict[int, object] = {}
    errors: list[BaseException] = []

    def build(rank: int) -> None:
        try:
            groups[rank] = make_group("gloo", store, rank, 2, timedelta(seconds=30), "127.0.0.2")
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(groups) == 2
    addresses = {address for _, address in listening_sockets() - before}
    assert addresses, "gloo opened no listening socket"
    assert addresses == {ASKED}, addresses
