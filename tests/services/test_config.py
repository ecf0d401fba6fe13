"""The default data directory (services/config.py): where root's learners can reach it."""

from __future__ import annotations

from pathlib import Path

from services.config import SYSTEM_DATA_DIR, default_data_dir


def home(tmp_path: Path, mode: int) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    path.chmod(mode)
    return path


def test_root_with_a_closed_home_keeps_its_data_under_var_lib(tmp_path: Path) -> None:
    assert default_data_dir(env="", home=home(tmp_path, 0o700), euid=0) == SYSTEM_DATA_DIR


def test_root_keeps_an_existing_personal_data_directory(tmp_path: Path) -> None:
    closed = home(tmp_path, 0o700)
    (closed / ".rhizome").mkdir()
    assert default_data_dir(env="", home=closed, euid=0) == closed / ".rhizome"


def test_root_with_a_home_others_can_enter_uses_it(tmp_path: Path) -> None:
    open_home = home(tmp_path, 0o711)
    assert default_data_dir(env="", home=open_home, euid=0) == open_home / ".rhizome"


def test_a_user_always_gets_the_personal_directory(tmp_path: Path) -> None:
    closed = home(tmp_path, 0o700)
    assert default_data_dir(env="", home=closed, euid=1000) == closed / ".rhizome"


def test_the_environment_wins(tmp_path: Path) -> None:
    chosen = tmp_path / "data"
    assert default_data_dir(env=str(chosen), home=home(tmp_path, 0o700), euid=0) == chosen
