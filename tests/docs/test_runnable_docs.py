"""Executable docs: every command that README.md and docs/*.md mark as runnable
(`<!-- runnable -->`, tests/docs/runnable.py, docs/executable-docs.md) is run here
against a real embedded platform (etcd, the MongoDB-wire and Elasticsearch-API servers
and the daemon, started by `rhizome up --embedded` on free ports and stopped by pid with
`rhizome down`), checking its exit code and the output the doc shows. A documented
command that stops working fails `make test`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs.runnable import Command, missing_output, runnable_commands

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RHIZOME = [sys.executable, "-m", "services.client.cli"]
COMMAND_TIMEOUT_S = 180


def documents_with_commands() -> list[Path]:
    return [p for p in DOCS if runnable_commands(p, ROOT)]


def doc_env(data_dir: Path) -> dict[str, str]:
    """What a reader's shell has after `make install`: the venv's `rhizome` on PATH; the
    data directory is the test's own platform's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RHIZOME_")}
    bin_dir = str(Path(sys.executable).parent)
    return {
        **env,
        "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        "RHIZOME_DATA_DIR": str(data_dir),
        "COLUMNS": "200",
    }


def ensure_up(data_dir: Path) -> None:
    """Start (or start again, after a documented `rhizome down`) the embedded platform."""
    env = doc_env(data_dir)
    if subprocess.run([*RHIZOME, "status"], env=env, capture_output=True).returncode == 0:
        return
    proc = subprocess.run(
        [*RHIZOME, "up", "--embedded", "--grpc-port", "0", "--rest-port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"the embedded platform did not start:\n{proc.stderr}"


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    data_dir = Path(tmp_path_factory.mktemp("docs-platform"))
    ensure_up(data_dir)
    try:
        yield data_dir
    finally:
        subprocess.run([*RHIZOME, "down"], env=doc_env(data_dir), capture_output=True)


def substitute(command: Command, ids: dict[str, str]) -> str:
    line = command.line
    for name in ("JOB_ID", "TOKEN_ID"):
        if re.search(rf"\b{name}\b", line):
            assert name in ids, (
                f"{command.source}: `{line}` uses {name}, but no runnable command before it "
                f"in this document made one (a `rhizome train` / `rhizome token create`)"
            )
            line = re.sub(rf"\b{name}\b", ids[name], line)
    return line


def remember_ids(output: str, ids: dict[str, str]) -> None:
    """The ids a `rhizome train` or `rhizome token create` printed, for later commands."""
    if found := re.search(r"^job (\S+) [A-Z]+", output, re.MULTILINE):
        ids["JOB_ID"] = found.group(1)
    if found := re.search(r"\btoken (tok_[0-9a-z]+) for ", output):
        ids["TOKEN_ID"] = found.group(1)


@pytest.mark.parametrize("doc", documents_with_commands(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_runnable_command_of_the_document_works(doc: Path, platform: Path) -> None:
    ensure_up(platform)
    ids: dict[str, str] = {}
    for command in runnable_commands(doc, ROOT):
        line = substitute(command, ids)
        started = time.monotonic()
        proc = subprocess.run(
            ["bash", "-c", line],
            cwd=ROOT,
            env=doc_env(platform),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # one stream: shown output is matched in its order
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        output = proc.stdout
        print(f"{command.source}: {time.monotonic() - started:.1f}s {line}")
        assert proc.returncode == 0, (
            f"{command.source}: `{line}` exited {proc.returncode}:\n{output[-3000:]}"
        )
        assert "Traceback" not in output, f"{command.source}: `{line}` printed a traceback"
        if command.shown:
            lacking = missing_output(command.shown, output)
            assert lacking is None, (
                f"{command.source}: `{line}` did not print a line like {lacking!r} "
                f"(the documented output); it printed:\n{output[-3000:]}"
            )
        remember_ids(output, ids)
        if line.split()[-1:] == ["down"] or " down " in f" {line} ":
            ensure_up(platform)  # the document stopped the platform; the rest needs it
