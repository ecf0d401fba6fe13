"""The leadership interface: who among several processes may act for a role.

A `Leadership` campaigns for a role in the background; `elected` is set while this
process holds it. `token()` is the fencing token of the term (as `token` in torch
elastic's rendezvous `set_state(state, token)`): it changes with every new holder, so a
write fenced on it fails for a deposed leader. Losing the role (the lease expired while
this process was away) calls `on_lost`: the holder must stop acting at once.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable


class LeadershipError(RuntimeError):
    """Leadership could not be campaigned for (the coordination store is unreachable)."""


class NotLeader(LeadershipError):
    """An operation that needs the role was attempted without it."""


class Leadership(ABC):
    def __init__(self) -> None:
        self.elected = threading.Event()

    @abstractmethod
    def campaign(self, on_elected: Callable[[], None], on_lost: Callable[[], None]) -> None:
        """Start campaigning in the background: `on_elected` once this process holds
        the role, `on_lost` if it then loses it."""

    @abstractmethod
    def token(self) -> int:
        """The fencing token of the current term; raises NotLeader when not elected."""

    @abstractmethod
    def holder(self) -> dict[str, object] | None:
        """What the current holder published about itself (pid, host, addresses), or None."""

    @abstractmethod
    def resign(self) -> None:
        """Stop campaigning and give the role up at once (a clean shutdown)."""
