"""`reachable_python`: the interpreter learner uids run where the daemon's own is private."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from services.backends.local import isolation
from services.backends.local.isolation import LearnerUser

ME = LearnerUser(os.getuid(), os.getgid())
VERSION = f"python{sys.version_info.major}.{sys.version_info.minor}"


def test_no_system_python_of_the_daemons_version_gives_none(tmp_path: Path) -> None:
    assert isolation.reachable_python(tmp_path, ME, search=[str(tmp_path / "empty")]) is None
    assert not (tmp_path / isolation.SHIM_DIR).exists()


def test_the_shim_runs_the_system_python_with_the_daemons_packages(tmp_path: Path) -> None:
    system = [d for d in isolation.SYSTEM_PYTHON_DIRS if (Path(d) / VERSION).is_file()]
    if not system:
        pytest.fail(f"no {VERSION} in {isolation.SYSTEM_PYTHON_DIRS}: install it to run this test")
    shim = isolation.reachable_python(tmp_path, ME)
    assert shim == tmp_path / isolation.SHIM_DIR / "bin" / "python"
    assert stat.S_IMODE(shim.stat().st_mode) == 0o755
    # It imports the platform's own packages (the daemon's site-packages and .pth files).
    out = subprocess.run(
        [str(shim), "-c", "import sys, grpc, contract; print(sys.executable)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
    ).stdout.strip()
    assert out == str(Path(system[0]) / VERSION)
    # A second call leaves the same files in place.
    before = shim.stat().st_mtime_ns
    assert isolation.reachable_python(tmp_path, ME) == shim
    assert shim.stat().st_mtime_ns == before
