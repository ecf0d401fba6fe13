"""The controller's small etcd client (learner/ never imports services/, so it cannot use
services/store/etcd.py): JSON values, a create-if-absent, a lease kept alive, a watch."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import pyetcd


class EtcdIO:
    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        parsed = urlparse(url if "://" in url else f"http://{url}")
        if not parsed.hostname or not parsed.port:
            raise ValueError(f"etcd URL {url!r} is not http://HOST:PORT")
        self.url = url
        self.client = pyetcd.client(host=parsed.hostname, port=parsed.port, timeout=timeout_s)

    def get(self, key: str) -> tuple[Any, int] | None:
        """(value, lease id) or None."""
        value, meta = self.client.get(key)
        if value is None:
            return None
        try:
            decoded = json.loads(value)
        except ValueError:
            decoded = value.decode(errors="replace")
        return decoded, int(meta.lease_id)

    def put(self, key: str, value: Any, lease: int | None = None) -> None:
        self.client.put(key, json.dumps(value, sort_keys=True), lease=lease)

    def create(self, key: str, value: Any, lease: int | None = None) -> bool:
        tx = self.client.transactions
        ok, _ = self.client.transaction(
            compare=[tx.create(key) == 0],
            success=[tx.put(key, json.dumps(value, sort_keys=True), lease=lease)],
            failure=[],
        )
        return bool(ok)

    def grant(self, ttl_s: int) -> int:
        return int(self.client.lease(ttl_s).id)

    def keep_alive(self, lease_id: int, ttl_s: int, stop: threading.Event) -> threading.Thread:
        def run() -> None:
            while not stop.wait(max(0.2, ttl_s / 4)):
                with contextlib.suppress(Exception):
                    list(self.client.refresh_lease(lease_id))

        thread = threading.Thread(target=run, name="lease", daemon=True)
        thread.start()
        return thread

    def revoke(self, lease_id: int) -> None:
        with contextlib.suppress(Exception):
            self.client.revoke_lease(lease_id)

    def watch(self, key: str, callback: Callable[[], None]) -> Callable[[], None]:
        watch_id = self.client.add_watch_callback(key, lambda _resp: callback())

        def cancel() -> None:
            with contextlib.suppress(Exception):
                self.client.cancel_watch(watch_id)

        return cancel

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
