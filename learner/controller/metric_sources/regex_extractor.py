"""`type: regex_extractor`: named regex groups of matching log lines become scalars.

    evaluation_metrics:
      type: regex_extractor
      in: stdout                 # stdout | stderr | a file under the learner's job dir
      line_lookahead: 2          # a match may span this many lines (default 1)
      eval_metric_vars:          # optional: `$name` in a regex expands to (?P<name>PATTERN)
        loss: '[-+0-9.eE]+'      # (a list of names uses a float pattern for each)
      groups:
        train:
          regex: 'step (?P<step>\\d+) loss=$loss'
          step: step             # the group holding the step (default: step or iteration)
          scalars: [loss]        # groups to report (default: every named group but the step)

A single `regex:` at the top level is a group without a label. Metric names are
`<label>/<group>` (`train/loss`), or the group name when there is no label.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from learner.controller.metric_sources.api import (
    LOG_STREAMS,
    MetricSource,
    MetricSourceError,
    Sample,
    register_source,
)
from learner.controller.metric_sources.tail import LineTailer

FLOAT = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf|NaN|Inf)"
_VAR = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")
_STEP_NAMES = ("step", "iteration", "iter")


class _Group:
    def __init__(self, label: str, spec: Mapping[str, Any], variables: Mapping[str, str]) -> None:
        pattern = spec.get("regex")
        if not isinstance(pattern, str) or not pattern:
            raise MetricSourceError(f"group {label or '(top level)'!r} needs a 'regex' string")

        def expand(m: re.Match[str]) -> str:
            name = m.group(1)
            if name not in variables:
                raise MetricSourceError(
                    f"regex of group {label!r} uses ${name}, which eval_metric_vars does not define"
                )
            return f"(?P<{name}>{variables[name]})"

        try:
            self.rx = re.compile(_VAR.sub(expand, pattern))
        except re.error as exc:
            raise MetricSourceError(f"regex of group {label!r} does not compile: {exc}") from exc
        names = list(self.rx.groupindex)
        if not names:
            raise MetricSourceError(
                f"regex of group {label!r} has no named group: write (?P<loss>...) or $loss"
            )
        step = spec.get("step")
        if step is None:
            step = next((n for n in _STEP_NAMES if n in names), None)
        elif step not in names:
            raise MetricSourceError(f"group {label!r}: step group {step!r} is not in its regex")
        self.step = step
        scalars = spec.get("scalars")
        if scalars is None:
            scalars = [n for n in names if n != step]
        if isinstance(scalars, Mapping):  # FfDL style: {out_name: "$var"}
            pairs = [(str(k), str(v).lstrip("$")) for k, v in scalars.items()]
        else:
            pairs = [(str(v).lstrip("$"), str(v).lstrip("$")) for v in scalars]
        for _, group in pairs:
            if group not in names:
                raise MetricSourceError(f"group {label!r}: scalar {group!r} is not in its regex")
        self.scalars = [(f"{label}/{out}" if label else out, group) for out, group in pairs]

    def samples(self, m: re.Match[str]) -> list[Sample]:
        step = 0
        if self.step is not None and m.group(self.step) is not None:
            try:
                step = int(float(m.group(self.step)))
            except ValueError:
                step = 0
        out = []
        for name, group in self.scalars:
            raw = m.group(group)
            if raw is None:
                continue
            try:
                out.append(Sample(name, float(raw), step))
            except ValueError:
                continue
        return out


class RegexExtractor(MetricSource):
    type = "regex_extractor"

    def __init__(self, spec: Mapping[str, Any], learner_dir: Path, source_id: str) -> None:
        super().__init__(spec, learner_dir, source_id)
        where = str(spec.get("in", "stdout"))
        self.lookahead = int(spec.get("line_lookahead", 1))
        if self.lookahead < 1:
            raise MetricSourceError(f"line_lookahead is {self.lookahead}; it must be >= 1")
        raw_vars = spec.get("eval_metric_vars") or {}
        if isinstance(raw_vars, list):
            variables = {str(v).lstrip("$"): FLOAT for v in raw_vars}
        elif isinstance(raw_vars, Mapping):
            variables = {str(k).lstrip("$"): str(v) for k, v in raw_vars.items()}
        else:
            raise MetricSourceError("eval_metric_vars must be a list of names or a mapping")
        groups = spec.get("groups")
        if groups is None:
            self.groups = [_Group("", spec, variables)]
        elif isinstance(groups, Mapping) and groups:
            self.groups = [_Group(str(label), g, variables) for label, g in groups.items()]
        else:
            raise MetricSourceError("groups must be a non-empty mapping of label -> {regex: ...}")
        self.tailer: LineTailer | None = None
        if where in LOG_STREAMS:
            self.stream = where
        else:
            self.tailer = LineTailer(self.resolve(where))
        self.pending: list[str] = []

    def feed(self, lines: list[str], final: bool) -> list[Sample]:
        self.pending.extend(lines)
        out: list[Sample] = []
        n = self.lookahead
        while self.pending and (len(self.pending) >= n or final):
            window = self.pending[:n]
            text = "\n".join(window) if n > 1 else window[0]
            used = 1
            for group in self.groups:
                m = group.rx.search(text)
                if m is None or m.start() > len(window[0]):
                    continue
                out.extend(group.samples(m))
                used = max(1, text.count("\n", 0, max(m.end() - 1, 0)) + 1)
                break
            del self.pending[:used]
        return out

    def poll(self, final: bool, max_records: int) -> list[Sample]:
        if self.tailer is None:
            return []
        return self.feed(self.tailer.read_lines(max_records, final), final)

    def state(self) -> dict[str, Any]:
        st: dict[str, Any] = {"pending": list(self.pending)}
        if self.tailer is not None:
            st["offset"] = self.tailer.offset
        return st

    def restore(self, state: Mapping[str, Any]) -> None:
        self.pending = list(state.get("pending", []))
        if self.tailer is not None:
            self.tailer.seek(int(state.get("offset", 0)))

    def close(self) -> None:
        if self.tailer is not None:
            self.tailer.close()


register_source("regex_extractor", RegexExtractor)
