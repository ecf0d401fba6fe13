"""The guardian takes its store URIs from the environment the LCM gives it (never its
command line) and pops them, so nothing it starts inherits them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.guardian.__main__ import _job_tls, main
from services.security.api import GUARDIAN_ETCD_URL_ENV, GUARDIAN_MONGODB_URI_ENV, JOB_TLS_ENV


def test_without_uris_the_guardian_names_both_ways_to_give_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(GUARDIAN_ETCD_URL_ENV, raising=False)
    monkeypatch.delenv(GUARDIAN_MONGODB_URI_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["--job-id=j", f"--data-dir={tmp_path}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--etcd or ${GUARDIAN_ETCD_URL_ENV}" in err
    assert f"--mongodb-uri or ${GUARDIAN_MONGODB_URI_ENV}" in err
    assert "Traceback" not in err


def test_the_uris_are_popped_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(GUARDIAN_ETCD_URL_ENV, "http://u:pw-in-env@127.0.0.1:1")
    monkeypatch.delenv(GUARDIAN_MONGODB_URI_ENV, raising=False)
    with pytest.raises(SystemExit):
        main(["--job-id=j", f"--data-dir={tmp_path}"])  # the MongoDB URI is missing
    assert GUARDIAN_ETCD_URL_ENV not in os.environ
    assert "pw-in-env" not in capsys.readouterr().err


def test_the_job_tls_variable_is_checked() -> None:
    assert _job_tls("") == {}
    assert _job_tls('{"ca": "A", "cert": "C", "key": "K"}') == {"ca": "A", "cert": "C", "key": "K"}
    with pytest.raises(ValueError, match=JOB_TLS_ENV):
        _job_tls("not json")
    with pytest.raises(ValueError, match="ca, cert and key"):
        _job_tls('{"ca": "A"}')
