"""The Spot estimate page's server side: `rhizome estimate` for a manifest text and a
bundled preemption trace (or a mean time to preemption), as rows for a chart.

It drives the same simulator inputs as the CLI (`services.sim.cli`'s manifest reading and
merging, its defaults), so the page and `rhizome estimate MANIFEST --trace T` agree."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import click

from services.dashboard.api import DashboardError

MAX_RUNS = 20
DEFAULT_RUNS = 5


# The CLI's messages name its flags; the page names the manifest's fields or its own.
_FLAG_NAMES = {
    "trace": "a trace",
    "mttp": "an MTTP",
    "on-demand-price": "estimate.prices.on_demand",
    "spot-price": "estimate.prices.spot",
}


def _page_words(message: str) -> str:
    return re.sub(
        r"--([a-z-]+)",
        lambda m: _FLAG_NAMES.get(m.group(1), "estimate." + m.group(1).replace("-", "_")),
        message,
    )


class EstimateRefused(DashboardError):
    """Inputs the simulator cannot take; the message names the field."""


def bundled_traces() -> list[str]:
    from services.sim import traces

    folder = Path(traces.__file__).parent / "data" / "traces"
    return sorted(p.name for p in folder.glob("*.csv"))


def estimate(manifest: str, trace: str, mttp: str, runs: int) -> dict[str, Any]:
    """Simulate the manifest's job under every strategy; rows as `rhizome estimate --json`."""
    from services.client.durations import parse_duration
    from services.sim.cli import DEFAULT_INTERVALS, build_inputs, manifest_fields
    from services.sim.model import SimInputError
    from services.sim.runner import simulate
    from services.sim.strategies import REGISTRY, RedundancyParams, factories

    if not 1 <= runs <= MAX_RUNS:
        raise EstimateRefused(f"runs must be between 1 and {MAX_RUNS}")
    if trace and trace not in bundled_traces():
        raise EstimateRefused(f"trace {trace!r} is not one of {', '.join(bundled_traces())}")
    opts: dict[str, Any] = {"trace": trace or None, "mttp": mttp.strip() or None}
    try:
        # The CLI's reader takes a file: the same code, so the same rules and messages.
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "manifest.yml"
            path.write_text(manifest)
            base = manifest_fields(path)
        job, model, prices = build_inputs(base, opts)
        intervals: list[tuple[float, str | None]] = [
            (parse_duration(i), None) for i in DEFAULT_INTERVALS
        ]
        strategies = factories(REGISTRY.names(), intervals=intervals, redundancy=RedundancyParams())
        rows = simulate(job, model, prices, strategies, runs=runs, seed=0)
    except click.ClickException as exc:
        raise EstimateRefused(_page_words(exc.format_message())) from None
    except (SimInputError, ValueError) as exc:
        raise EstimateRefused(str(exc)) from None
    return {
        "job": job.name,
        "model": model.label,
        "nodes": job.nodes,
        "runs": runs,
        "rows": [r.to_dict() for r in rows],
    }
