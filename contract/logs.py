"""The log streams of a learner, as its collector ships them to the training data service.

The user command's stdout and stderr go to `<job_dir>/learners/<rank>/stdout.log` and
`stderr.log`; the collector tails those (`COMMAND_STREAMS`), and a metric source may read
one of them by name. The TDS also accepts the controller's own log (`controller`).
"""

from __future__ import annotations

from enum import StrEnum


class LogStream(StrEnum):
    STDOUT = "stdout"
    STDERR = "stderr"
    CONTROLLER = "controller"


# What the TDS accepts in a log line's `stream`.
LOG_STREAMS: tuple[str, ...] = tuple(s.value for s in LogStream)
# What the user command writes (the collector tails them; metric regexes read them).
COMMAND_STREAMS: tuple[str, ...] = (LogStream.STDOUT.value, LogStream.STDERR.value)
