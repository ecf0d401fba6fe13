"""Metric sources of a learner (FfDL's `evaluation_metrics`): one module per type.

from learner.controller.metric_sources import create_sources
sources = create_sources(manifest.get("evaluation_metrics"), learner_dir)
"""

from learner.controller.metric_sources.api import (
    MetricSource,
    MetricSourceError,
    Sample,
    create_sources,
    register_source,
)

__all__ = ["MetricSource", "MetricSourceError", "Sample", "create_sources", "register_source"]
