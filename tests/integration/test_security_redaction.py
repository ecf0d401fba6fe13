"""A daemon given password-bearing store URIs never prints the password: its log and its
error output are grepped after runs that reach, and fail to reach, each store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from contract.procs import free_port
from services.embedded.process import ManagedServer

PASSWORD = "Hunter2-pw-s3cret"


def _run_daemon(tmp_path: Path, *args: str) -> str:
    """rhizomed with `args` until it gives up on an unreachable store; all it printed."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.daemon",
            f"--data-dir={tmp_path / 'data'}",
            f"--grpc-address=127.0.0.1:{free_port()}",
            f"--rest-address=127.0.0.1:{free_port()}",
            "--metrics-address=",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0, "the daemon should have refused the unreachable store"
    return proc.stdout + proc.stderr


def test_unreachable_mongodb_uri_is_printed_without_its_password(tmp_path: Path) -> None:
    out = _run_daemon(
        tmp_path,
        f"--mongodb-uri=mongodb://rzuser:{PASSWORD}@127.0.0.1:{free_port()}/db",
        "--services=api",
    )
    assert "MongoDB at mongodb://rzuser:***@127.0.0.1:" in out
    assert PASSWORD not in out


def test_unreachable_etcd_url_is_printed_without_its_password(
    tmp_path: Path, mongo_server: ManagedServer
) -> None:
    out = _run_daemon(
        tmp_path,
        f"--mongodb-uri={mongo_server.url}",
        f"--etcd=http://rzuser:{PASSWORD}@127.0.0.1:{free_port()}",
        "--services=lcm",
    )
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.rglob("*.log"))
    assert "rzuser:***@127.0.0.1" in out
    assert PASSWORD not in out + logs
