"""Leadership by an etcd key under a lease: create-if-absent wins the role.

The holder writes `leaders/<role>` with its lease and what others need to know about it
(pid and start time, host, its addresses). A contender polls:
- the key is absent (the holder resigned, or its lease expired): create it;
- the holder runs on this host and its process is gone (SIGKILL): revoke its lease and
  create the key at once, rather than wait out the TTL. Between reads of the key the
  contender only looks at /proc, so noticing a local death costs no etcd round trip;
- else wait. A holder on another host is replaced within the lease's TTL.
The fencing token is the key's revision when this process created it: every new term
has a larger one.

The holder refreshes its lease itself (not `Lease.keep_alive`) so it also notices when it
could not refresh for most of the TTL: a contender may hold the role by then, so it
reports the loss rather than go on acting.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from contract import etcd_keys, procs
from contract.etcd import EtcdClient, Lease, StoreUnavailable
from services.leader.api import Leadership, LeadershipError, NotLeader

log = logging.getLogger("rhizome.leader")


class EtcdLeadership(Leadership):
    def __init__(
        self,
        etcd: EtcdClient,
        role: str,
        info: dict[str, object] | None = None,
        ttl_s: int = 2,
        poll_s: float = 0.02,
        read_every_s: float = 0.25,
    ) -> None:
        super().__init__()
        self.etcd = etcd
        self.role = role
        self.key = etcd_keys.leader(role)
        self.ttl_s = ttl_s
        self.poll_s = poll_s
        self.read_every_s = read_every_s
        me = procs.ProcRef.of(os.getpid())
        self.info: dict[str, object] = {
            **(info or {}),
            "pid": os.getpid(),
            "start": me.start if me else 0,
            "host": socket.gethostname(),
        }
        self._lease: Lease | None = None
        self._token = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: dict[str, object] | None = None

    # -- the interface ---------------------------------------------------------------------
    def campaign(self, on_elected: Callable[[], None], on_lost: Callable[[], None]) -> None:
        if self._thread is not None:
            raise LeadershipError(f"already campaigning for {self.role}")
        self._thread = threading.Thread(
            target=self._run, args=(on_elected, on_lost), name=f"leader-{self.role}", daemon=True
        )
        self._thread.start()

    def token(self) -> int:
        if not self.elected.is_set():
            raise NotLeader(f"this process does not hold {self.role}")
        return self._token

    def holder(self) -> dict[str, object] | None:
        if self.elected.is_set():
            return dict(self.info)
        with contextlib.suppress(StoreUnavailable):
            entry = self.etcd.get(self.key)
            if entry is not None and isinstance(entry.value, dict):
                return dict(entry.value)
        return None

    def resign(self) -> None:
        self._stop.set()
        lease, self._lease = self._lease, None
        self.elected.clear()
        if lease is not None:
            lease.revoke()  # the key goes with it: a standby takes over without waiting
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)

    # -- campaigning -------------------------------------------------------------------------
    def _run(self, on_elected: Callable[[], None], on_lost: Callable[[], None]) -> None:
        read_at = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            seen = self._seen
            local_death = (
                seen is not None
                and seen.get("host") == self.info["host"]
                and not procs.ref_alive(seen.get("pid"), seen.get("start"))
            )
            if seen is None or local_death or now - read_at >= self.read_every_s:
                read_at = now
                try:
                    won = self._try_take()
                except StoreUnavailable as exc:
                    log.warning("leadership of %s: %s; trying again", self.role, exc)
                    won = False
                if won:
                    break
            self._stop.wait(self.poll_s)
        if self._stop.is_set():
            return
        self.elected.set()
        log.info("this process holds %s (term %d)", self.role, self._token)
        on_elected()
        if self._hold():
            return  # resigned
        self.elected.clear()
        log.error("lost %s: its lease could not be refreshed in time", self.role)
        on_lost()

    def _try_take(self) -> bool:
        entry = self.etcd.get(self.key)
        if entry is not None and isinstance(entry.value, dict):
            value = entry.value
            if value.get("host") == self.info["host"] and not procs.ref_alive(
                value.get("pid"), value.get("start")
            ):
                log.info(
                    "the holder of %s (pid %s) is gone; taking over without waiting for its lease",
                    self.role,
                    value.get("pid"),
                )
                self.etcd.revoke(entry.lease)
                entry = None
            else:
                self._seen = value
                return False
        elif entry is not None:
            return False  # not ours to judge: wait for its lease
        lease = self.etcd.grant(self.ttl_s)
        if not self.etcd.create(self.key, {**self.info, "lease": lease.id}, lease):
            lease.revoke()
            self._seen = None  # someone else was quicker: read who next time
            return False
        created = self.etcd.get(self.key)
        if created is None or created.lease != lease.id:
            lease.revoke()
            return False
        self._lease = lease
        self._token = created.mod_revision
        return True

    def _hold(self) -> bool:
        """Refresh the lease until resigned (True) or until it is lost (False)."""
        period = max(0.1, self.ttl_s / 4)
        refreshed = time.monotonic()
        while not self._stop.wait(period):
            lease = self._lease
            if lease is None:
                return True
            try:
                if not lease.refresh():
                    return False
                refreshed = time.monotonic()
            except StoreUnavailable:
                log.warning("leadership of %s: lease refresh failed", self.role)
            # Most of the TTL without a refresh: a contender may hold the role already.
            if time.monotonic() - refreshed >= 0.8 * self.ttl_s:
                return False
        return True
