"""The preemption injector: replays a spot trace (or exponential inter-arrivals for a
given MTTP) against a running job's learner processes — SIGTERM with the configured
notice, SIGKILL when the grace runs out — and records what it did.

`python -m services.injector --help`; `services.injector.cli.inject` is the click command
the `rhizome` CLI registers as `rhizome inject`.
"""

from services.injector.injector import Injection, Injector, exponential_schedule, trace_schedule
from services.injector.targets import (
    InjectorError,
    JobNotRunningError,
    JobTargets,
    PidTargets,
    UnknownJobError,
)

__all__ = [
    "Injection",
    "Injector",
    "InjectorError",
    "JobNotRunningError",
    "JobTargets",
    "PidTargets",
    "UnknownJobError",
    "exponential_schedule",
    "trace_schedule",
]
