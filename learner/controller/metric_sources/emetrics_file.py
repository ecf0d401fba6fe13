"""`type: emetrics_file`: a JSON-lines file the training script appends to.

    evaluation_metrics:
      type: emetrics_file
      in: evaluation-metrics.txt     # default; relative to the learner's job dir

Two line shapes are read:
- FfDL's: {"meta": {"time": <ms>}, "grouplabel": "train",
           "etimes": {"iteration": {"type": 2, "value": 10}},
           "values": {"loss": {"type": 3, "value": 0.5}}}
  (a value may also be a bare number) -> train/loss at step 10;
- flat:   {"step": 10, "time": <s>, "loss": 0.5, "acc": 0.9} -> loss and acc at step 10.
A line that is not valid JSON is skipped and counted in `bad_lines`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from learner.controller.metric_sources.api import MetricSource, Sample, register_source
from learner.controller.metric_sources.tail import LineTailer

_STEP_KEYS = ("step", "iteration", "iter", "epoch")


def _number(v: Any) -> float | None:
    if isinstance(v, Mapping):
        v = v.get("value")
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def parse_line(obj: Any) -> list[Sample]:
    if not isinstance(obj, Mapping):
        return []
    if "values" in obj and isinstance(obj["values"], Mapping):
        label = str(obj.get("grouplabel") or "")
        etimes = obj.get("etimes") or {}
        step = 0
        for k in _STEP_KEYS:
            if k in etimes and _number(etimes[k]) is not None:
                step = int(_number(etimes[k]) or 0)
                break
        meta = obj.get("meta") or {}
        t = _number(meta.get("time")) if isinstance(meta, Mapping) else None
        time_us = int(t * 1000) if t is not None else None  # FfDL: milliseconds
        out = []
        for name, raw in obj["values"].items():
            v = _number(raw)
            if v is not None:
                out.append(Sample(f"{label}/{name}" if label else str(name), v, step, time_us))
        return out
    step_v = next((_number(obj[k]) for k in _STEP_KEYS if k in obj), None)
    t = _number(obj.get("time"))
    time_us = int(t * 1e6) if t is not None and math.isfinite(t) else None
    skip = {*_STEP_KEYS, "time"}
    return [
        Sample(str(k), v, int(step_v or 0), time_us)
        for k, raw in obj.items()
        if k not in skip and (v := _number(raw)) is not None
    ]


class EmetricsFile(MetricSource):
    type = "emetrics_file"

    def __init__(self, spec: Mapping[str, Any], learner_dir: Path, source_id: str) -> None:
        super().__init__(spec, learner_dir, source_id)
        self.tailer = LineTailer(self.resolve(str(spec.get("in", "evaluation-metrics.txt"))))
        self.bad_lines = 0

    def poll(self, final: bool, max_records: int) -> list[Sample]:
        out: list[Sample] = []
        for line in self.tailer.read_lines(max_records, final):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                self.bad_lines += 1
                continue
            out.extend(parse_line(obj))
        return out

    def state(self) -> dict[str, Any]:
        return {"offset": self.tailer.offset}

    def restore(self, state: Mapping[str, Any]) -> None:
        self.tailer.seek(int(state.get("offset", 0)))

    def close(self) -> None:
        self.tailer.close()


register_source("emetrics_file", EmetricsFile)
