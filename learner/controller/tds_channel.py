"""The collector's channel to the training data service (TDS).

`RenewingStub` opens the channel again whenever the learner's renewed client certificate
changes (the guardian rewrites `tds-tls.json`; docs/security.md), so a collector that
outlives its first certificate keeps shipping. `tls_from_environ` is how a collector run
as a process gets its first certificate, and `retryable` says which TDS answers a caller
retries (the TDS or its search server away for a moment) rather than gives up on.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc
from rhizome.v1 import tds_pb2_grpc

from contract.containers import COLLECTOR_TLS_ENV
from contract.credentials import (
    internal_channel,
    tls_channel_credentials,
    tls_from_json,
    with_bearer,
)

log = logging.getLogger(__name__)

# The TDS answers a collector retries with backoff, holding its place.
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
}


def retryable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() in RETRYABLE


class RenewingStub:
    """The TDS stub of a collector, over a channel opened again whenever the learner's
    renewed client certificate (`tds_file`, JSON `{ca, cert, key}` the guardian writes)
    changes; until there is one, the spec's `tls`. Attribute access returns a function
    that calls the current stub, so a call bound once (a retried one) follows a renewal."""

    CHECK_INTERVAL_S = 1.0

    def __init__(
        self, address: str, token: str, tls: Mapping[str, str] | None, tds_file: Path
    ) -> None:
        self.address, self.token, self.tds_file = address, token, tds_file
        self._lock = threading.Lock()
        self._seen: tuple[int, int] | None = None
        self._checked = 0.0
        self._channel = self._open(tls)
        self._stub = tds_pb2_grpc.TrainingDataStub(self._channel)
        self._current()  # a renewed certificate from before a restart wins at once

    def _open(self, tls: Mapping[str, str] | None) -> grpc.Channel:
        # With `tls` the channel is mutual TLS (the internal port of a TLS platform admits
        # only certificates of its CA); the job token goes on every call on top.
        raw = internal_channel(
            self.address,
            tls_channel_credentials(tls) if tls else None,
            options=[
                # Reconnect quickly after a TDS restart (grpc's default backoff reaches 120 s);
                # not min_reconnect_backoff_ms, which is each attempt's connect timeout
                # (contract/etcd.py `_CHANNEL`).
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
            ],
        )
        return with_bearer(raw, self.token)

    def _current(self) -> Any:
        now = time.monotonic()
        with self._lock:
            if now - self._checked < self.CHECK_INTERVAL_S and self._seen is not None:
                return self._stub
            self._checked = now
            try:
                st = self.tds_file.stat()
            except OSError:
                return self._stub  # no renewal yet
            seen = (st.st_mtime_ns, st.st_size)
            if seen == self._seen:
                return self._stub
            try:
                tls = json.loads(self.tds_file.read_text())
                channel = self._open(tls)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("renewed TDS certificate in %s not usable: %s", self.tds_file, exc)
                return self._stub
            self._seen = seen
            old, self._channel = self._channel, channel
            self._stub = tds_pb2_grpc.TrainingDataStub(channel)
            old.close()
            log.info("TDS channel opened again with the renewed certificate")
            return self._stub

    def __getattr__(self, name: str) -> _RenewingMethod:
        return _RenewingMethod(self, name)

    def close(self) -> None:
        with self._lock:
            self._channel.close()


class _RenewingMethod:
    """One RPC of a RenewingStub: called, or `.future(...)` (the collector keeps several
    batches in flight), each on the channel of the newest certificate."""

    def __init__(self, stub: RenewingStub, name: str) -> None:
        self.stub = stub
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.stub._current(), self.name)(*args, **kwargs)

    def future(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.stub._current(), self.name).future(*args, **kwargs)


def tls_from_environ() -> dict[str, str]:
    """As a process, the collector's TLS client certificate (`COLLECTOR_TLS_ENV`, JSON
    `{ca, cert, key}`); {} when unset (a plaintext platform). ValueError when malformed."""
    return tls_from_json(os.environ.get(COLLECTOR_TLS_ENV, ""), COLLECTOR_TLS_ENV)
