"""Load shedding for submits: a bounded number in flight, the rest refused with a retry-after.

Without a bound, a burst beyond what the store can write queues up in the gRPC and REST
thread pools until clients time out: silently, and without saying whether the job was
stored. A gate in front of the submit path turns overload into an immediate, explicit
answer (RESOURCE_EXHAUSTED / HTTP 429 with a retry-after) for the callers it cannot take,
before anything is written, so a refused submit stored nothing and an accepted one runs
at full speed. The bound is below the API's thread pools (32 each), so reads, halts and
log streams keep threads of their own while submits are at their limit.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from services.api import errors

DEFAULT_MAX_IN_FLIGHT = 24
# How long a submit may wait for a slot before it is refused: enough to ride out a
# momentary burst (one group commit takes milliseconds), short against client timeouts.
DEFAULT_MAX_WAIT_S = 0.5
RETRY_AFTER_S = 1.0


class SubmitGate:
    def __init__(
        self, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, max_wait_s: float = DEFAULT_MAX_WAIT_S
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, not {max_in_flight}")
        self.max_in_flight = max_in_flight
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._max_wait_s = max_wait_s
        self.shed = 0  # refused submits, for metrics and tests

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one of the slots while a submit runs, or raise Overloaded."""
        if not self._slots.acquire(timeout=self._max_wait_s):
            self.shed += 1
            raise errors.Overloaded(
                f"the API is at its limit of {self.max_in_flight} submits in flight; nothing "
                f"was stored: retry after {RETRY_AFTER_S:g} s (rhizomed --max-submits-in-flight "
                "raises the limit)",
                retry_after_s=RETRY_AFTER_S,
            )
        try:
            yield
        finally:
            self._slots.release()
