"""`type: logger` (FfDL's simple log collector): the logs are collected, no metrics are
extracted. Useful to state explicitly that a job reports no metrics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from learner.controller.metric_sources.api import MetricSource, register_source


class LoggerSource(MetricSource):
    type = "logger"

    def state(self) -> dict[str, Any]:
        return {}

    def restore(self, state: Mapping[str, Any]) -> None:
        pass


register_source("logger", LoggerSource)
