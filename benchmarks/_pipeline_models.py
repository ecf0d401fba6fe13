"""The pipeline model the runtime benchmarks share: issue #24's char GPT
(examples/pipeline-gpt/train.py) in the shape that issue measured — embedding and 4
pre-norm blocks of width 128, 4 heads, context 64, 4 microbatches of 8 sequences."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from learner.runtime.api import PipelineJob  # noqa: E402


def example_gpt_module() -> Any:
    """examples/pipeline-gpt/train.py as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location(
        "pipeline_gpt", REPO / "examples/pipeline-gpt/train.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def issue24_gpt_job(steps: int, redundancy: str) -> PipelineJob:
    job: PipelineJob = example_gpt_module().gpt_job(
        steps=steps,
        microbatches=4,
        dim=128,
        layers=4,
        heads=4,
        context=64,
        batch=8,
        redundancy=redundancy,
    )
    return job
