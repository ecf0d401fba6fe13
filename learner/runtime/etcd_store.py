"""The rendezvous store of a pipeline job on the platform: a ``torch.distributed.Store``
kept in the platform's etcd, under ``etcd_keys.runtime_store_prefix(job_id)``.

Every link and all-reduce group of every generation is built from it
(``PrefixStore(f"gen{g}/...", store)``, learner/runtime/comm.py). Off the platform the
launcher hosts a ``TCPStore``; on the platform there is no launcher, and a store inside
one learner would die with that learner — exactly when the survivors need it to build the
next generation's links. etcd is already where the runtime's state, leases and
rendezvous records live, it outlives every learner and every platform process (the
guardian included: a guardian restarted by the LCM changes nothing here), and the guardian
erases the job's ``runtime/`` keys when the job ends, so nothing is left behind.

Values are bytes (gloo's addresses); they are kept base64-encoded in the contract's JSON
values. ``get``/``wait`` poll with a short back-off (1 ms doubling to 20 ms): building a
link needs a handful of keys, each present within milliseconds.
"""

from __future__ import annotations

import base64
import time
from datetime import timedelta

import torch.distributed as dist

from contract import etcd_keys
from contract.etcd import EtcdClient


def _enc(value: bytes | str) -> str:
    raw = value.encode() if isinstance(value, str) else bytes(value)
    return base64.b64encode(raw).decode()


def _dec(value: object) -> bytes:
    return base64.b64decode(str(value))


class EtcdStore(dist.Store):
    """A ``dist.Store`` on etcd: set, get, add, compare_set, wait, check, delete_key,
    num_keys (the operations gloo and ``PrefixStore`` use)."""

    def __init__(self, endpoint: str, job_id: str, timeout: timedelta = timedelta(seconds=60)):
        super().__init__()
        self._client = EtcdClient(endpoint, timeout_s=10)
        self.prefix = etcd_keys.runtime_store_prefix(job_id)
        self._timeout = timeout

    def _key(self, key: str) -> str:
        return self.prefix + key

    # -- the Store interface ----------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:  # type: ignore[override]
        self._client.put(self._key(key), _enc(value))

    def get(self, key: str) -> bytes:  # type: ignore[override]
        self.wait([key])
        entry = self._client.get(self._key(key))
        if entry is None:  # deleted between the wait and the read
            raise RuntimeError(f"rendezvous key {key!r} vanished")
        return _dec(entry.value)

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        full = self._key(key)
        while True:
            entry = self._client.get(full)
            current = int(_dec(entry.value).decode()) if entry is not None else 0
            new = current + int(amount)
            if self._client.cas(full, _enc(str(new)), entry.mod_revision if entry else 0):
                return new

    def compare_set(  # type: ignore[override]
        self, key: str, expected: bytes | str, desired: bytes | str
    ) -> bytes:
        full = self._key(key)
        want = expected.encode() if isinstance(expected, str) else bytes(expected)
        while True:
            entry = self._client.get(full)
            if entry is None:
                if want:
                    return want
                if self._client.create(full, _enc(desired)):
                    return desired.encode() if isinstance(desired, str) else bytes(desired)
                continue
            current = _dec(entry.value)
            if current != want:
                return current
            if self._client.cas(full, _enc(desired), entry.mod_revision):
                return desired.encode() if isinstance(desired, str) else bytes(desired)

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        return all(self._client.get(self._key(k)) is not None for k in keys)

    def wait(  # type: ignore[override]
        self, keys: list[str], timeout: timedelta | None = None
    ) -> None:
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        pause = 0.001
        pending = list(keys)
        while pending:
            pending = [k for k in pending if self._client.get(self._key(k)) is None]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"timed out after {limit:.0f}s waiting for rendezvous keys {pending}"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        full = self._key(key)
        existed = self._client.get(full) is not None
        self._client.delete(full)
        return existed

    def num_keys(self) -> int:  # type: ignore[override]
        return len(self._client.get_prefix(self.prefix))

    def set_timeout(self, timeout: timedelta) -> None:  # type: ignore[override]
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:  # type: ignore[override]
        return self._timeout

    def close(self) -> None:
        self._client.close()
