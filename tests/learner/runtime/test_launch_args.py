"""On the platform the manifest's pipeline: section decides the launcher's shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.runtime.launch import parse_args


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def test_off_the_platform_the_flags_decide(monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    for var in ("RHIZOME_PIPELINE_STAGES", "RHIZOME_PIPELINE_PIPELINES"):
        monkeypatch.delenv(var, raising=False)
    args = parse_args(["--stages", "3", script])
    assert (args.stages, args.pipelines, args.microbatches) == (3, 1, None)
    with pytest.raises(SystemExit):
        parse_args([script])  # no shape at all


def test_the_manifest_shape_is_used_without_flags(
    monkeypatch: pytest.MonkeyPatch, script: str
) -> None:
    monkeypatch.setenv("RHIZOME_PIPELINE_STAGES", "2")
    monkeypatch.setenv("RHIZOME_PIPELINE_PIPELINES", "2")
    monkeypatch.setenv("RHIZOME_PIPELINE_REDUNDANCY", "lazy-frc-lazy-brc")
    monkeypatch.setenv("RHIZOME_PIPELINE_MICROBATCHES", "8")
    args = parse_args([script])
    assert (args.stages, args.pipelines, args.redundancy, args.microbatches) == (
        2,
        2,
        "lazy-frc-lazy-brc",
        8,
    )


def test_a_flag_that_contradicts_the_manifest_is_refused(
    monkeypatch: pytest.MonkeyPatch, script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RHIZOME_PIPELINE_STAGES", "2")
    assert parse_args(["--stages", "2", script]).stages == 2  # repeating it is fine
    with pytest.raises(SystemExit):
        parse_args(["--stages", "4", script])
    assert "--stages 4 disagrees with the manifest's pipeline.stages (2)" in capsys.readouterr().err


def test_inside_a_platform_pipeline_learner_the_launcher_refuses(
    monkeypatch: pytest.MonkeyPatch, script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # What the learner controller of a pipeline job gives its command: this process is
    # already one worker; a launcher here would train P x D more times.
    from contract.env import LearnerEnv, RuntimeEnv

    env = LearnerEnv(job_id="job-1", rank=1, pipeline_stages=2, pipeline_pipelines=1)
    runtime = RuntimeEnv.for_learner(env, "http://127.0.0.1:2379")
    assert runtime is not None
    for key, value in {**env.to_environ(), **runtime.to_environ()}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit):
        parse_args([script])
    assert "already pipeline worker 1 of job job-1" in capsys.readouterr().err
