"""Elastic jobs through the whole embedded platform (real etcd, MongoDB-wire server and
Elasticsearch-API server, the local backend, the scheduler): examples/elastic-regression
is submitted with `rhizome train`, scaled 2 → 3 → 2 with `rhizome scale` while it
trains, and completes; every epoch used each sample exactly once (the sample logs every
worker wrote, checked by the library's own test helpers) and the history shows both
changes; a count outside the bounds and a scale of the ended job are refused, saying
why."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_cli import rz
from tests.integration.test_elastic import (
    assert_counters_never_go_back,
    assert_exactly_once,
    committed_steps,
)

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "elastic-regression"
# The example trains 30 epochs (360 steps, ~75 s at its --step-delay of 0.2 s); both scale
# events land by step ~85 (a third-learner start included), so a copy trains 16 (192
# steps) and leaves a margin. Once the second scale event is in the history the test
# opens a gate and the copy's remaining steps skip the delay: they showed nothing more
# at 0.2 s a step (and took ~20 s).
EPOCHS = 16
STEP_DELAY = "time.sleep(args.step_delay)"


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    data_dir = Path(tmp_path_factory.mktemp("elastic-jobs"))
    rz(data_dir, "up", "--embedded", "--grpc-port", "0", "--rest-port", "0")
    try:
        yield data_dir
    finally:
        rz(data_dir, "down", check=False)


def show(platform: Path, job_id: str) -> dict[str, Any]:
    return dict(json.loads(rz(platform, "show", job_id, "--json").stdout))


def wait_for(
    platform: Path, job_id: str, what: str, cond: Callable[[], bool], timeout_s: float = 180
) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached; the job is {show(platform, job_id)}")
        time.sleep(0.5)


def stdout(platform: Path, job_id: str, rank: int) -> str:
    path = platform / "jobs" / job_id / "learners" / str(rank) / "stdout.log"
    return path.read_text() if path.exists() else ""


def sample_records(platform: Path, job_id: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted((platform / "jobs" / job_id / "results").glob("*/samples.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def widest_step(platform: Path, job_id: str) -> int:
    """The most workers any step logged so far has (a line being written is skipped)."""
    widest = 0
    for path in (platform / "jobs" / job_id / "results").glob("*/samples.jsonl"):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            widest = max(widest, len(rec.get("samples", ())))
    return widest


def test_rhizome_scale_takes_an_elastic_job_2_to_3_to_2_while_it_trains(
    platform: Path, tmp_path: Path
) -> None:
    example = tmp_path / "elastic-regression"
    shutil.copytree(EXAMPLE, example)
    manifest = example / "manifest.yml"
    text = manifest.read_text()
    assert "--epochs 30 " in text, "the example's epochs changed: update EPOCHS' comment"
    manifest.write_text(text.replace("--epochs 30 ", f"--epochs {EPOCHS} "))
    gate = tmp_path / "go"
    train = example / "train.py"
    code = train.read_text()
    assert STEP_DELAY in code, "the example's step delay changed: update the gate"
    train.write_text(
        code.replace(
            STEP_DELAY, f"time.sleep(0.0 if Path({str(gate)!r}).exists() else args.step_delay)"
        )
    )
    out = rz(platform, "train", str(manifest), "--json").stdout
    job_id = str(json.loads(out)["job_id"])
    wait_for(
        platform,
        job_id,
        "two learners training",
        lambda: all("step 20 " in stdout(platform, job_id, r) for r in (0, 1)),
    )

    refused = rz(platform, "scale", job_id, "9", check=False)
    assert refused.returncode != 0
    assert "learners=9 is outside the job's elastic bounds [1, 4]" in refused.stderr

    scaled = rz(platform, "scale", job_id, "3", "--json")
    assert json.loads(scaled.stdout)["resources"]["learners"] == 3, scaled.stderr
    wait_for(
        platform,
        job_id,
        "learner 2 joined the workers",
        lambda: "joined generation" in stdout(platform, job_id, 2),
    )
    # Scaled in only once three workers trained a step: on a loaded machine the scale-in
    # could come before the first step of the three (and the check below found none).
    wait_for(
        platform,
        job_id,
        "a step trained by three workers",
        lambda: widest_step(platform, job_id) == 3,
    )

    scaled = rz(platform, "scale", job_id, "2", "--json")
    assert json.loads(scaled.stdout)["resources"]["learners"] == 2, scaled.stderr
    wait_for(
        platform,
        job_id,
        "learner 2 left",
        lambda: any(
            "scaled 3 → 2 learners: learner 2 left" in e["message"]
            for e in show(platform, job_id)["history"]
        ),
    )
    gate.touch()

    wait_for(
        platform,
        job_id,
        "the end",
        lambda: show(platform, job_id)["status"] in ("COMPLETED", "FAILED"),
        timeout_s=300,
    )
    job = show(platform, job_id)
    assert job["status"] == "COMPLETED", job
    history = [e["message"] for e in job["history"]]
    assert any("scaled 2 → 3 learners: learner 2 joined" in m for m in history), history
    assert any("scaled 3 → 2 learners: learner 2 left" in m for m in history), history

    late = rz(platform, "scale", job_id, "3", check=False)
    assert late.returncode != 0
    assert "is COMPLETED: a running elastic job is scaled while it is PROCESSING" in late.stderr

    records = sample_records(platform, job_id)
    steps = committed_steps(records)
    assert_counters_never_go_back(records)
    assert_exactly_once(steps)
    # some steps were trained by three workers, and the last ones by two again
    widths = [len(r["samples"]) for r in steps]
    assert 3 in widths and widths[-1] == 2, widths
