"""Where a lost pipeline learner's replacement runs: the scheduler decides (ReplaceLearner).

A pipeline learner lost to a preemption points at its node, which may be going away, so
its replacement is a gang of one the scheduler places on another node
(`GangScheduler.replace_learner`: the lost learner's share is given back, the job's quota
charge does not change). The guardian reaches the scheduler's internal port as the other
platform processes do: the service credential as a bearer token and, on a TLS platform,
a client certificate of the platform's CA (the job's, which the LCM hands it).

When the scheduler cannot answer — unreachable, no other node with room now — the
guardian asks again `tries` times, `retry_s` apart (without blocking its monitoring
round), then falls back to what it did before the scheduler was asked: the replacement
reuses the lost learner's node, whose allocation the scheduler still holds for the job.
An answer that asking again cannot change (the scheduler does not know the job, refuses
the credential) falls back at once. Every outcome is one history line
(`ReplacementPlanner.decide`'s `Decision.note`); nothing here raises.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from contract.credentials import internal_channel, tls_channel_credentials, with_bearer

log = logging.getLogger("rhizome.guardian")

# Status codes after which asking again may help (the scheduler restarts, the network
# drops a call); any other code is an answer that will not change.
_TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclasses.dataclass(frozen=True)
class SchedulerAccess:
    """How the guardian reaches the scheduler: `host:port` of its internal port, the
    service credential, the `{ca, cert, key}` client certificate (empty: plaintext)."""

    address: str
    token: str = dataclasses.field(default="", repr=False)
    tls: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)


@dataclasses.dataclass(frozen=True)
class Decision:
    """Where the replacement of a lost learner starts: `node`, the job's new placement
    (`learner_nodes` by rank; equal to the old one on a fallback) and the history line
    saying who chose and why."""

    node: str
    placement: dict[str, Any]
    note: str
    chosen_by_scheduler: bool


class ReplacementPlanner:
    """Asks the scheduler where a lost learner's replacement goes; remembers, per rank,
    the tries made so far so that a monitoring round never waits between them."""

    def __init__(
        self,
        access: SchedulerAccess | None,
        *,
        tries: int = 3,
        retry_s: float = 1.0,
        timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if tries < 1:
            raise ValueError("the guardian must ask the scheduler at least once (tries >= 1)")
        self.access = access
        self.tries = tries
        self.retry_s = retry_s
        self.timeout_s = timeout_s
        self.clock = clock
        self._channel: grpc.Channel | None = None
        # rank -> (failed tries so far, when to ask again)
        self._pending: dict[int, tuple[int, float]] = {}

    def _stub(self) -> Any:
        from rhizome.v1 import scheduler_pb2_grpc

        assert self.access is not None
        if self._channel is None:
            tls = tls_channel_credentials(self.access.tls) if self.access.tls else None
            self._channel = with_bearer(
                internal_channel(self.access.address, tls), self.access.token
            )
        return scheduler_pb2_grpc.SchedulerStub(self._channel)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def decide(self, job_id: str, rank: int, placement: dict[str, Any]) -> Decision | None:
        """Where learner `rank`'s replacement starts, given the job's current `placement`;
        None while a retry is due later (ask again next round). Without a scheduler (a
        platform that places jobs itself) the replacement reuses the lost node, as always."""
        nodes = {str(k): str(v) for k, v in (placement.get("learner_nodes") or {}).items()}
        old = nodes.get(str(rank), "local")
        if self.access is None or not self.access.address:
            return Decision(old, placement, "", chosen_by_scheduler=False)
        tried, not_before = self._pending.get(rank, (0, 0.0))
        if self.clock() < not_before:
            return None
        from rhizome.v1 import scheduler_pb2

        why = ""
        try:
            got = self._stub().ReplaceLearner(
                scheduler_pb2.ReplaceLearnerRequest(job_id=job_id, rank=rank),
                timeout=self.timeout_s,
            )
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            why = f"the scheduler at {self.access.address} answered {getattr(code, 'name', code)}: {detail}"
            if code not in _TRANSIENT:
                self._pending.pop(rank, None)
                return self._fallback(rank, old, placement, why)
        except ValueError as exc:  # unusable TLS material: asking again cannot help
            self._pending.pop(rank, None)
            return self._fallback(rank, old, placement, f"cannot reach the scheduler: {exc}")
        else:
            if got.placed:
                self._pending.pop(rank, None)
                new_nodes = {**nodes, str(rank): got.node}
                return Decision(
                    got.node,
                    {**placement, "learner_nodes": new_nodes},
                    f"learner {rank}'s replacement runs on node {got.node}, chosen by the "
                    f"scheduler (a gang of one; learner {rank} was lost on node {old})",
                    chosen_by_scheduler=True,
                )
            why = f"the scheduler has no node for it now: {got.reason}"
        tried += 1
        if tried >= self.tries:
            self._pending.pop(rank, None)
            return self._fallback(rank, old, placement, f"{why} (asked {tried} times)")
        log.info("job %s: learner %d's replacement: %s; asking again", job_id, rank, why)
        self._pending[rank] = (tried, self.clock() + self.retry_s)
        return None

    @staticmethod
    def _fallback(rank: int, old: str, placement: dict[str, Any], why: str) -> Decision:
        return Decision(
            old,
            placement,
            f"learner {rank}'s replacement reuses node {old}, where learner {rank} was lost: {why}",
            chosen_by_scheduler=False,
        )
