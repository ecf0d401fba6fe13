"""The extraction of runnable commands from Markdown and the matching of shown output
(tests/docs/runnable.py), without a platform."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.runnable import MARKER, missing_output, runnable_commands

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(text)
    return path


def test_only_marked_blocks_are_runnable_and_console_output_is_kept(tmp_path: Path) -> None:
    page = write(
        tmp_path,
        "```sh\nrhizome not-marked\n```\n"
        f"{MARKER}\n```sh\nrhizome list   # a comment\n# a comment line\n\nrhizome cluster\n```\n"
        f"{MARKER}\n```console\n$ rhizome train m.yml\njob JOB_ID QUEUED\n$ rhizome version\n```\n",
    )
    commands = runnable_commands(page, tmp_path)
    assert [c.line for c in commands] == [
        "rhizome list   # a comment",
        "rhizome cluster",
        "rhizome train m.yml",
        "rhizome version",
    ]
    assert commands[2].shown == ["job JOB_ID QUEUED"] and commands[3].shown == []
    assert commands[0].source == "page.md:6"


def test_a_marker_without_a_shell_block_or_an_unclosed_block_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be followed by"):
        runnable_commands(write(tmp_path, f"{MARKER}\n```python\nx = 1\n```\n"), tmp_path)
    with pytest.raises(ValueError, match="never closed"):
        runnable_commands(write(tmp_path, f"{MARKER}\n```sh\nrhizome list\n"), tmp_path)


def test_shown_output_matches_in_order_with_placeholders() -> None:
    actual = "packaging x ...\njob 20261123-ab12 QUEUED\nmore\n"
    assert missing_output(["job JOB_ID QUEUED"], actual) is None
    assert missing_output(["packaging ...", "job JOB_ID ..."], actual) is None
    assert missing_output(["job JOB_ID QUEUED", "packaging ..."], actual) == "packaging ..."
    assert missing_output(["job JOB_ID RUNNING"], actual) == "job JOB_ID RUNNING"


def test_the_readme_has_runnable_commands() -> None:
    """The harness cannot pass by finding nothing: the README marks its session."""
    commands = runnable_commands(ROOT / "README.md", ROOT)
    verbs = {c.line.split()[1] for c in commands if c.line.split()[0].endswith("rhizome")}
    assert {"train", "list", "show", "logs", "halt", "resume", "estimate", "token"} <= verbs
