"""How an etcd client finds its credentials (contract/etcd.py `credentials_from_env`): the
file `$RHIZOME_ETCD_CREDENTIALS_FILE` names, refused with a message naming the variable
when it is missing, readable by others or malformed (never a silent fallback to no
identity). No server is needed: the client resolves them before it connects."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.env import ETCD_CREDENTIALS_FILE
from contract.etcd import EtcdAuthError, EtcdClient, EtcdCredentials, credentials_from_env
from services.security.etcd_auth import EtcdAuthFiles


def test_unset_means_no_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ETCD_CREDENTIALS_FILE, raising=False)
    assert credentials_from_env() is None


def test_the_named_file_is_read(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "platform.credentials"
    EtcdCredentials("rhizome-platform", "s3cret").write(path)
    monkeypatch.setenv(ETCD_CREDENTIALS_FILE, str(path))
    assert credentials_from_env() == EtcdCredentials("rhizome-platform", "s3cret")


@pytest.mark.parametrize(
    ("content", "mode", "expected"),
    [
        (None, 0o600, "cannot be read"),
        ("user:pw-not-printed\n", 0o644, "chmod 600"),
        ("no-colon\n", 0o600, "USER:PASSWORD"),
    ],
)
def test_a_bad_file_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    content: str | None,
    mode: int,
    expected: str,
) -> None:
    path = tmp_path / "etcd.credentials"
    if content is not None:
        path.write_text(content)
        path.chmod(mode)
    monkeypatch.setenv(ETCD_CREDENTIALS_FILE, str(path))
    with pytest.raises(EtcdAuthError, match=expected) as err:
        EtcdClient("http://127.0.0.1:1")  # refused before any connection
    assert ETCD_CREDENTIALS_FILE in str(err.value)
    assert "pw-not-printed" not in str(err.value)


def test_anonymous_ignores_the_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ETCD_CREDENTIALS_FILE, str(tmp_path / "missing"))
    EtcdClient("http://127.0.0.1:1", anonymous=True).close()  # no error: not read


def test_a_helper_is_told_the_platform_user_and_the_daemon_root_too(tmp_path: Path) -> None:
    files = EtcdAuthFiles.of(tmp_path)
    assert set(files.client_environ()) == {ETCD_CREDENTIALS_FILE}
    daemon = files.daemon_environ()
    assert daemon[ETCD_CREDENTIALS_FILE] == str(files.platform)
    assert str(files.root) in daemon.values()
