"""The launcher's own flags, off the platform (on it, the learners are the workers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.runtime.launch import parse_args, worker_device


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def test_the_flags_decide_the_shape_and_microbatches(script: str) -> None:
    args = parse_args(["--stages", "3", "--microbatches", "8", script])
    assert (args.stages, args.pipelines, args.microbatches) == (3, 1, 8)


@pytest.mark.parametrize(
    "flags",
    [
        ["--microbatches", "0"],
        ["--stages", "0"],
        ["--standbys", "-1"],
        ["--standbys", "65"],
        ["--checkpoint-every", "-1"],
        ["--max-pipelines", "0"],
        ["--max-pipelines", "257"],
        ["--max-pipelines", "1", "--pipelines", "2"],
    ],
)
def test_out_of_range_flags_are_refused(
    script: str, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args([*(["--stages", "2"] if "--stages" not in flags else []), *flags, script])
    assert flags[0] in capsys.readouterr().err  # the error names the flag


def test_growth_is_off_unless_asked_for(script: str) -> None:
    assert parse_args(["--stages", "2", "--pipelines", "3", script]).max_pipelines == 3
    assert parse_args(["--stages", "2", "--max-pipelines", "2", script]).max_pipelines == 2


def test_nccl_is_refused_with_fewer_gpus_than_workers(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit):
        parse_args(["--stages", "2", "--standbys", "1", "--backend", "nccl", script])
    err = capsys.readouterr().err
    assert "--backend nccl needs one GPU per worker: 3 workers" in err, err
    assert "2 GPU(s) visible" in err, err
    # enough GPUs: accepted, and each worker gets its own
    args = parse_args(["--stages", "2", "--backend", "nccl", script])
    assert [worker_device(args.backend, w) for w in range(2)] == ["cuda:0", "cuda:1"]
    assert worker_device("gloo", 1) is None  # the runtime's default: CPU


def test_an_unknown_backend_is_refused(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--stages", "2", "--backend", "mpi", script])
    assert "--backend" in capsys.readouterr().err
