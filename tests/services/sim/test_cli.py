"""`python -m services.sim` and the `estimate` click command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from services.sim.cli import estimate, simulate_cmd

REPO = Path(__file__).resolve().parents[3]
TRACE = REPO / "tests" / "learner" / "checkpoint" / "fixtures" / "one-removal.csv"


def test_module_help_explains_every_option() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.sim", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in (
        "--steps",
        "--step-time",
        "--save-time",
        "--backup-time",
        "--alloc-time",
        "--prep-time",
        "--stages",
        "--pipelines",
        "--trace",
        "--mttp",
        "--notice",
        "--strategy",
        "--interval",
        "--overhead",
        "--failover",
        "--reconfig",
        "--degraded-slowdown",
        "--runs",
        "--seed",
        "--json",
    ):
        assert flag in out


def test_estimate_reads_the_manifest_and_prints_json(tmp_path: Path) -> None:
    manifest = tmp_path / "job.yaml"
    manifest.write_text(
        "name: gpt2-small\nlearners: 4\ninstance_type: p3.2xlarge\n"
        "pipeline: {stages: 2, pipelines: 2, redundancy: true}\n"
        "estimate: {steps: 500, step_time: 2s, save_time: 10s, backup_time: 20s,"
        " alloc_time: [30, 60], prep_time: 30-60, samples_per_step: 64}\n"
    )
    result = CliRunner().invoke(
        estimate,
        [
            str(manifest),
            "--trace",
            str(TRACE),
            "--runs",
            "2",
            "--json",
            "--interval",
            "5m",
            "--notice",
            "0",
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["job"] == "gpt2-small"
    names = [r["strategy"] for r in doc["rows"]]
    assert names == ["on-demand", "checkpoint-restart/5m", "adaptive", "redundant"]
    on_demand = doc["rows"][0]
    # 500 steps * 2 s on 4 nodes at the p3.2xlarge on-demand price
    assert on_demand["cost"] == pytest.approx(1000 / 3600 * 4 * 3.06)


def test_estimate_says_what_is_missing(tmp_path: Path) -> None:
    manifest = tmp_path / "job.yaml"
    manifest.write_text("name: x\nlearners: 2\n")
    result = CliRunner().invoke(estimate, [str(manifest), "--trace", str(TRACE)])
    assert result.exit_code == 2
    assert "missing --steps, --step-time, --save-time" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("- not a mapping\n")
    result = CliRunner().invoke(estimate, [str(bad), "--trace", str(TRACE)])
    assert result.exit_code == 2 and "must be a YAML mapping" in result.output


def test_simulate_needs_exactly_one_preemption_model() -> None:
    args = [
        "--steps",
        "10",
        "--step-time",
        "1",
        "--save-time",
        "1",
        "--on-demand-price",
        "3",
        "--spot-price",
        "1",
    ]
    result = CliRunner().invoke(simulate_cmd, args)
    assert result.exit_code == 2 and "--trace FILE or --mttp" in result.output
    ok = CliRunner().invoke(
        simulate_cmd, [*args, "--mttp", "2h", "--runs", "1", "--strategy", "adaptive"]
    )
    assert ok.exit_code == 0 and "adaptive" in ok.output
