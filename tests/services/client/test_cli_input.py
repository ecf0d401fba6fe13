"""The `rhizome` CLI without a platform: global options before or after the command,
bad input (non-UTF-8 arguments and files, missing paths, a directory for a file, an
unreachable daemon, a stale data directory), a busy explicit port, shell completion and
`rhizome doctor`. Each bad input is one line on stderr, a non-zero exit, no traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

RHIZOME = [sys.executable, "-m", "services.client.cli"]
# a user's environment, but the test session's machine-wide uid marks (tests/conftest.py)
KEPT = {"RHIZOME_MACHINE_UID_CLAIMS"}
UNREACHABLE = "127.0.0.1:1"  # nothing listens on port 1


def rz(*args: str | bytes, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RHIZOME_") or k in KEPT}
    proc = subprocess.run(
        [*RHIZOME, *args],
        capture_output=True,
        text=True,
        errors="replace",
        env={**base, "COLUMNS": "200", **(env or {})},
        timeout=60,
    )
    return proc


def one_clear_line(proc: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert proc.returncode == code, f"exit {proc.returncode}, stderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, f"{needle!r} not in:\n{proc.stderr}"


def stale(tmp_path: Path) -> Path:
    """A data directory whose platform.json an older Rhizome wrote (another shape)."""
    data = tmp_path / "old-data"
    data.mkdir()
    (data / "platform.json").write_text(
        json.dumps({"data_dir": str(data), "pids": {"api": 1}, "api_port": 50051})
    )
    return data


def test_global_options_are_accepted_after_the_command(tmp_path: Path) -> None:
    before = rz("--data-dir", str(tmp_path), "status", "--json")
    after = rz("status", "--json", "--data-dir", str(tmp_path))
    assert before.returncode == after.returncode == 1  # nothing runs there
    assert json.loads(after.stdout)["data_dir"] == json.loads(before.stdout)["data_dir"]
    assert json.loads(after.stdout)["data_dir"] == str(tmp_path.resolve())
    # --api after the command: the call goes there (and says so).
    one_clear_line(rz("list", "--api", UNREACHABLE), 1, f"Rhizome API at {UNREACHABLE}")
    # a job-id prefix is resolved against the API given after it, not the default one
    one_clear_line(rz("show", "abc", "--api", UNREACHABLE), 1, f"Rhizome API at {UNREACHABLE}")
    # --json before the command reaches the command's own --json
    assert (
        json.loads(rz("--json", "status", "--data-dir", str(tmp_path)).stdout)["running"] is False
    )


def test_up_takes_data_dir_after_the_command(tmp_path: Path) -> None:
    data = stale(tmp_path)
    proc = rz("up", "--embedded", "--data-dir", str(data))
    one_clear_line(proc, 1, str(data / "platform.json"), "another version of Rhizome")


def test_a_non_utf8_argument_is_named_not_a_decode_error() -> None:
    proc = rz("show", b"job-\xff\xfe")
    one_clear_line(proc, 2, "argument 2", "not valid UTF-8")
    assert "UnicodeEncodeError" not in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_a_non_utf8_manifest_is_named_with_the_byte(tmp_path: Path) -> None:
    manifest = tmp_path / "manifest.yml"
    manifest.write_bytes(b"name: caf\xe9\nframework:\n  command: python t.py\n")
    proc = rz("train", str(manifest), "--api", UNREACHABLE)
    one_clear_line(proc, 1, str(manifest), "not UTF-8 text", "0xe9", "save the manifest as UTF-8")


def test_missing_manifest_and_a_directory_for_a_file_are_usage_errors(tmp_path: Path) -> None:
    one_clear_line(rz("train", str(tmp_path / "nope.yml")), 2, "nope.yml", "does not exist")
    one_clear_line(rz("train", str(tmp_path)), 2, "is a directory")
    manifest = tmp_path / "m.yml"
    manifest.write_text("name: x\nframework: {command: c}\n")
    one_clear_line(rz("train", str(manifest), str(manifest)), 2, "is a file")


def test_an_unreachable_daemon_is_named_with_how_to_start_it() -> None:
    proc = rz("list", env={"RHIZOME_API": UNREACHABLE})
    one_clear_line(
        proc, 1, f"cannot reach the Rhizome API at {UNREACHABLE}", "rhizome up --embedded"
    )
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_stale_data_dir_is_one_line_naming_the_file_and_the_fix(tmp_path: Path) -> None:
    data = stale(tmp_path)
    for args in (("status",), ("down",), ("list",)):
        proc = rz("--data-dir", str(data), *args)
        one_clear_line(proc, 1, "platform.json", "another version of Rhizome", "mv ")
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_up_with_a_busy_explicit_port_names_who_holds_it(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc = rz("up", "--embedded", "--data-dir", str(tmp_path), "--grpc-port", str(port))
    one_clear_line(proc, 1, f"--grpc-port {port}", f"port {port} is in use by", "--grpc-port 0")
    assert f"pid {os.getpid()}" in proc.stderr  # this test's process holds it
    assert not (tmp_path / "deps").exists()  # nothing was started


def test_completion_scripts_and_completing_a_command() -> None:
    for shell in ("bash", "zsh", "fish"):
        proc = rz("completion", shell)
        assert proc.returncode == 0 and "_RHIZOME_COMPLETE" in proc.stdout, proc.stderr
    one_clear_line(rz("completion", "tcsh"), 2, "tcsh")
    # what the bash script asks: the candidates for `rhizome tr<TAB>`
    proc = rz(
        env={"_RHIZOME_COMPLETE": "bash_complete", "COMP_WORDS": "rhizome tr", "COMP_CWORD": "1"}
    )
    assert proc.returncode == 0 and "plain,train" in proc.stdout.splitlines(), proc.stdout


def test_doctor_reports_each_check_and_the_fix_for_a_stale_data_dir(tmp_path: Path) -> None:
    fresh = json.loads(rz("doctor", "--json", "--data-dir", str(tmp_path / "new")).stdout)
    names = {c["name"] for c in fresh["checks"]}
    assert {
        "python",
        "etcd",
        "data dir",
        "disk",
        "port 50051",
        "docker engine",
        "chromium",
    } <= names
    assert all(c["fix"] for c in fresh["checks"] if c["state"] != "ok")
    proc = rz("doctor", "--json", "--data-dir", str(stale(tmp_path)))
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    data = next(c for c in report["checks"] if c["name"] == "data dir")
    assert report["ok"] is False and data["state"] == "fail" and "mv " in data["fix"]
    text = rz("doctor", "--data-dir", str(tmp_path / "new"))
    assert "check" in text.stdout and "Traceback" not in text.stderr


def test_commands_of_other_modules_take_the_global_options_after_their_name_too() -> None:
    """`rhizome scale`, `download` and `events` live in modules of their own (plugged into
    the group): `--api` after their name reached no code ("No such option") until they
    were given the global options as the group's own commands are."""
    for args in (
        ("scale", "abc", "3"),
        ("download", "abc"),
        ("events", "list", "abc", "completed"),
        ("token", "list"),
    ):
        one_clear_line(rz(*args, "--api", UNREACHABLE), 1, f"Rhizome API at {UNREACHABLE}")
