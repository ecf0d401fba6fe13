"""Placement policies, registered by name.

- ``pack``      BSA (biased sampling) with the PACK objective: fill nodes, keep the gang on
                few nodes (FfDL §3.5). The default.
- ``spread``    BSA with the SPREAD objective: one learner per node on the emptiest nodes.
- ``first-fit`` nodes in configuration order, each filled as far as the gang allows.
- ``exact``     the optimum of the PACK objective by dynamic programming (the objective is
                a sum over nodes); O(nodes × learners²), for benchmarks and small clusters.

Every policy is zone-aware for jobs that ask for it (``JobRequest.zone_aware``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from contract.registry import Registry
from services.scheduler.api import PlacementPolicy, UnknownPolicy

POLICIES: Registry[Callable[..., PlacementPolicy]] = Registry(
    "placement policy", error=UnknownPolicy
)


def register_policy(name: str, factory: Callable[..., PlacementPolicy] | str) -> None:
    """Make ``factory(**options)`` available as ``get_policy(name, **options)``."""
    POLICIES.register(name, factory)


def get_policy(name: str, **options: Any) -> PlacementPolicy:
    return POLICIES.get(name)(**options)


def policy_names() -> list[str]:
    return POLICIES.names()


def _register_builtin() -> None:
    from services.scheduler.placement.baselines import ExactPackPolicy, FirstFitPolicy
    from services.scheduler.placement.bsa import BsaPolicy

    register_policy("pack", lambda **kw: BsaPolicy(objective="pack", **kw))
    register_policy("spread", lambda **kw: BsaPolicy(objective="spread", **kw))
    register_policy("first-fit", lambda **kw: FirstFitPolicy())
    register_policy("exact", lambda **kw: ExactPackPolicy())


_register_builtin()

__all__ = ["get_policy", "policy_names", "register_policy"]
