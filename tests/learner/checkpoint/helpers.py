"""Helpers the checkpoint store tests share (test_storage, test_s3_store)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def kill_writer_when_ready(
    writer: str, args: list[str], ready: Path, what: str, env: dict[str, str] | None = None
) -> None:
    """Run the script `writer` (its `{repo}` filled in) with `args`; once it creates
    `ready` it hangs in the middle of `what`, and is SIGKILLed there."""
    script = ready.parent / "writer.py"
    script.write_text(writer.format(repo=str(REPO)))
    proc = subprocess.Popen([sys.executable, str(script), *args], env=env)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, f"writer exited before reaching {what}"
            assert time.monotonic() < deadline, f"writer never reached {what}"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
