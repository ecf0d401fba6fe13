"""Scaling policies for running elastic jobs, registered by name (see ``api``).

- ``none``              the scheduler never resizes a job by itself (the default)
- ``elastic-tiresias``  Amoeba §6: shrink elastic jobs outside Tiresias's first queue to
                        admit waiting jobs; grow them into idle capacity (``tiresias``)

Selected in the cluster config (``--cluster-config``)::

    scheduler:
      scaling: elastic-tiresias
      scaling_options: {pending_threshold: 0, quanta_gpu_s: [10000, 200000]}
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from contract.registry import Registry
from services.scheduler.elasticity.api import (
    ScalingConfigError,
    ScalingPolicy,
    StaticScaling,
    UnknownScalingPolicy,
)

SCALING_POLICIES: Registry[Callable[..., ScalingPolicy]] = Registry(
    "scaling policy", error=UnknownScalingPolicy
)


def _static(**options: Any) -> ScalingPolicy:
    if options:
        raise ScalingConfigError(f"scaling policy 'none' takes no options, got {sorted(options)}")
    return StaticScaling()


SCALING_POLICIES.register("none", _static)
SCALING_POLICIES.register(
    "elastic-tiresias", "services.scheduler.elasticity.tiresias:elastic_tiresias"
)


def get_scaling_policy(name: str, **options: Any) -> ScalingPolicy:
    return SCALING_POLICIES.get(name)(**options)


_KEYS = {"scaling", "scaling_options"}


def scaling_from_config(
    config: Any, source: str = "cluster config", base_dir: Path | None = None
) -> ScalingPolicy:
    """The scaling policy of a parsed cluster config (its optional ``scheduler:``
    section); ``none`` when there is none. Every error names the key and the fix. A
    relative ``throughput_curve`` is taken from ``base_dir`` (the config file's folder),
    as a user who keeps the curve beside the config expects, not from wherever the daemon
    was started."""
    if not isinstance(config, Mapping):
        return StaticScaling()
    section = config.get("scheduler")
    if section is None:
        return StaticScaling()
    if not isinstance(section, Mapping):
        raise ScalingConfigError(
            f"{source}: 'scheduler' must be a mapping, e.g. {{scaling: elastic-tiresias}}"
        )
    for key in section:
        if key not in _KEYS:
            hint = difflib.get_close_matches(str(key), list(_KEYS), n=1)
            maybe = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ScalingConfigError(f"{source}: scheduler: unknown key {key!r}{maybe}")
    name = str(section.get("scaling", "none"))
    options = section.get("scaling_options") or {}
    if not isinstance(options, Mapping):
        raise ScalingConfigError(f"{source}: scheduler.scaling_options must be a mapping")
    options = {str(k): v for k, v in options.items()}
    curve = options.get("throughput_curve")
    if base_dir is not None and isinstance(curve, str) and not Path(curve).is_absolute():
        options["throughput_curve"] = str(base_dir / curve)
    try:
        return get_scaling_policy(name, **options)
    except UnknownScalingPolicy as exc:
        raise ScalingConfigError(f"{source}: scheduler.scaling: {exc}") from None
    except ScalingConfigError as exc:
        raise ScalingConfigError(f"{source}: scheduler.scaling_options: {exc}") from None
    except TypeError as exc:  # a value of the wrong type reaching the policy
        raise ScalingConfigError(f"{source}: scheduler.scaling_options: {exc}") from None


def load_scaling_config(path: str | Path) -> ScalingPolicy:
    """The scaling policy named in a cluster config file (``none`` if it names none)."""
    p = Path(path)
    try:
        config = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ScalingConfigError(f"cannot read cluster config {p}: {exc}") from None
    return scaling_from_config(config, str(p), base_dir=p.parent)


__all__ = [
    "SCALING_POLICIES",
    "ScalingConfigError",
    "ScalingPolicy",
    "UnknownScalingPolicy",
    "get_scaling_policy",
    "load_scaling_config",
    "scaling_from_config",
]
