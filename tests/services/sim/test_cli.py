"""`python -m services.sim` and the `estimate` click command."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from services.sim.cli import estimate, mttp_from_hourly_probability, simulate_cmd

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
        "framework: {command: python train.py}\n"
        "pipeline: {stages: 2, pipelines: 2}\n"
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
    manifest.write_text("name: x\nlearners: 2\nframework: {command: python train.py}\n")
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
    assert result.exit_code == 2 and "--trace FILE, --mttp DURATION or" in result.output
    ok = CliRunner().invoke(
        simulate_cmd, [*args, "--mttp", "2h", "--runs", "1", "--strategy", "adaptive"]
    )
    assert ok.exit_code == 0 and "adaptive" in ok.output


# --- issue #20 -------------------------------------------------------------------------

MANIFEST = (
    "name: est\nframework: {command: python train.py}\n"
    "estimate: {steps: 100, step_time: 1s, save_time: 2s, backup_time: 0, notice: 45s,"
    " prices: {on_demand: 3, spot: 1}}\n"
)
SIM_ARGS = [
    "--steps",
    "100",
    "--step-time",
    "1",
    "--save-time",
    "2",
    "--on-demand-price",
    "3",
    "--spot-price",
    "1",
    "--runs",
    "1",
    "--json",
]


def _json(result: Any) -> dict[str, Any]:
    assert result.exit_code == 0, result.output
    doc: dict[str, Any] = json.loads(result.output)
    return doc


def test_estimate_keeps_the_manifest_notice_unless_the_flag_is_given(tmp_path: Path) -> None:
    manifest = tmp_path / "job.yaml"
    manifest.write_text(MANIFEST)
    args = [str(manifest), "--mttp", "5h", "--runs", "1", "--json", "--strategy", "adaptive"]
    assert _json(CliRunner().invoke(estimate, args))["notice_s"] == 45.0
    given = _json(CliRunner().invoke(estimate, [*args, "--notice", "10s"]))
    assert given["notice_s"] == 10.0
    # 0 is a notice too (none at all), not "unset"
    assert _json(CliRunner().invoke(estimate, [*args, "--notice", "0"]))["notice_s"] == 0.0


def test_estimate_reads_the_manifest_through_the_typed_parser(tmp_path: Path) -> None:
    manifest = tmp_path / "job.yaml"
    # a field the schema refuses is reported by the schema's name for it
    manifest.write_text(MANIFEST + "pipeline: {stages: 0}\n")
    result = CliRunner().invoke(estimate, [str(manifest), "--mttp", "5h"])
    assert result.exit_code == 2 and "pipeline.stages" in result.output
    assert "Traceback" not in result.output


def test_preemption_probability_per_hour_becomes_the_node_mttp() -> None:
    doc = _json(
        CliRunner().invoke(
            simulate_cmd, [*SIM_ARGS, "--preemption-probability", "0.1", "--strategy", "adaptive"]
        )
    )
    # P(preempted within 1 h) = 1 - exp(-1 h / MTTP): MTTP = 1 h / -ln(0.9) = 34,168 s
    assert doc["job_mttp_s"] == pytest.approx(3600 / -math.log(0.9), rel=1e-6)
    assert mttp_from_hourly_probability(0.5) == pytest.approx(3600 / math.log(2))


@pytest.mark.parametrize("p", ["0", "1", "1.5", "-0.2"])
def test_a_probability_outside_0_1_is_refused_in_one_line(p: str) -> None:
    result = CliRunner().invoke(simulate_cmd, [*SIM_ARGS, "--preemption-probability", p])
    assert result.exit_code == 2
    assert "--preemption-probability must be between 0 and 1" in result.output
    assert "Traceback" not in result.output


def test_two_preemption_models_are_refused() -> None:
    result = CliRunner().invoke(
        simulate_cmd, [*SIM_ARGS, "--mttp", "2h", "--preemption-probability", "0.1"]
    )
    assert result.exit_code == 2
    assert "(got --mttp, --preemption-probability)" in result.output


def test_checkpoint_interval_in_steps_is_steps_times_step_time() -> None:
    args = [*SIM_ARGS, "--mttp", "1000h", "--strategy", "checkpoint-restart"]
    doc = _json(CliRunner().invoke(simulate_cmd, [*args, "--interval-steps", "25"]))
    (row,) = doc["rows"]
    assert row["strategy"] == "checkpoint-restart/25 steps"
    # 100 steps of 1 s, a save every 25 s of training: 4 saves (the last at the very end)
    assert row["saves"] >= 3
    by_time = _json(CliRunner().invoke(simulate_cmd, [*args, "--interval", "25s"]))
    assert by_time["rows"][0]["saves"] == row["saves"]
    assert by_time["rows"][0]["time_h"] == pytest.approx(row["time_h"])


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--interval", "0", "a checkpoint interval must be > 0"),
        ("--interval-steps", "0", "a checkpoint interval must be >= 1 step"),
    ],
)
def test_an_interval_of_zero_is_refused_in_one_line(flag: str, value: str, message: str) -> None:
    result = CliRunner().invoke(simulate_cmd, [*SIM_ARGS, "--mttp", "2h", flag, value])
    assert result.exit_code == 2 and message in result.output
    assert "Traceback" not in result.output


def test_daly_interval_and_finished_runs_are_printed() -> None:
    result = CliRunner().invoke(
        simulate_cmd, [*SIM_ARGS[:-1], "--mttp", "10h", "--notice", "0", "--strategy", "adaptive"]
    )
    assert result.exit_code == 0, result.output
    # δ 2 s, job MTTP 10 h, R 60-300 + 60-180 s (mean 300 s): sqrt(2·2·36300) = 381 s
    assert "Daly-optimal interval sqrt(2·δ·(MTTP+R)) = 381 s" in result.output
    assert "finished" in result.output and "1/1" in result.output


def test_redundancy_on_one_stage_warns_and_counts_fatal_failures() -> None:
    args = [*SIM_ARGS, "--steps", "3000", "--mttp", "20m", "--strategy", "redundant", "--runs", "3"]
    doc = _json(CliRunner().invoke(simulate_cmd, args))
    assert any("1-stage job" in n and "every preemption is fatal" in n for n in doc["notes"])
    (row,) = doc["rows"]
    assert row["fatal_failures"] == row["restarts"] > 0
    two = _json(CliRunner().invoke(simulate_cmd, [*args, "--stages", "2"]))
    assert not any("1-stage job" in n for n in two["notes"])


def test_errors_name_the_program_as_it_was_run() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.sim", "--steps", "x"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert "Usage: python -m services.sim" in out.stderr
    script = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.argv[0] = 'rhizome-spot-sim'; "
            "from services.sim.cli import main; main()",
            "--steps",
            "x",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert "Usage: rhizome-spot-sim" in script.stderr, script.stderr


def test_a_bad_trace_is_one_line_naming_the_line(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("0,add,a\n5000,remove,a\n1000,add,b\n")
    result = CliRunner().invoke(simulate_cmd, [*SIM_ARGS, "--trace", str(trace)])
    assert result.exit_code == 2
    assert f"{trace}:3: time goes backwards" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--mttp", "1h", "--samples-per-step", "0"], "samples_per_step must be >= 1, got 0"),
        (["--mttp", "1h", "--stages", "0"], "stages must be >= 1, got 0"),
        (["--mttp", "1h", "--pipelines", "-1"], "pipelines must be a whole number >= 1"),
        (["--trace", str(REPO)], "is not a file"),
        (["--trace", sys.executable], "cannot read trace"),
        (["--mttp", "1h", "--spot-price", "0"], "prices must be > 0"),
    ],
)
def test_bad_simulator_input_is_one_line(extra: list[str], message: str) -> None:
    result = CliRunner().invoke(simulate_cmd, [*SIM_ARGS, *extra])
    assert result.exit_code == 2 and message in result.output
    # a usage error (SystemExit 2), not an exception escaping the command
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)


def test_bad_manifest_prices_are_one_line(tmp_path: Path) -> None:
    manifest = tmp_path / "job.yaml"
    manifest.write_text(MANIFEST.replace("on_demand: 3", "on_demand: cheap"))
    result = CliRunner().invoke(estimate, [str(manifest), "--mttp", "5h"])
    assert result.exit_code == 2
    assert "the on-demand price must be a number of dollars per node-hour" in result.output
