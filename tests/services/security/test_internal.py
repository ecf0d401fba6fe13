"""The internal port's credentials on their own: the secret file, job tokens, refusals."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from services.security.api import CredentialError
from services.security.internal import SharedSecretCredentials


def test_the_secret_is_generated_0600_once_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "data" / "internal.secret"
    first = SharedSecretCredentials.from_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = SharedSecretCredentials.from_file(path)
    assert again.service_token() == first.service_token()
    assert first.service_token().startswith("rz_svc_")


def test_a_secret_file_others_can_read_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "internal.secret"
    SharedSecretCredentials.from_file(path)
    path.chmod(0o644)
    with pytest.raises(CredentialError, match="chmod 600"):
        SharedSecretCredentials.from_file(path)


def test_a_missing_secret_is_an_error_when_it_may_not_be_created(tmp_path: Path) -> None:
    with pytest.raises(CredentialError, match="no service secret"):
        SharedSecretCredentials.from_file(tmp_path / "none", create=False)


def test_job_tokens_name_their_job_and_cannot_be_moved_to_another(tmp_path: Path) -> None:
    creds = SharedSecretCredentials.from_file(tmp_path / "s")
    token = creds.job_token("job-1.with.dots")
    assert creds.identify(token).job_id == "job-1.with.dots"
    assert creds.identify(creds.service_token()).is_service
    mac = token.split(".", 1)[0]
    for forged in (f"{mac}.job-2", token + "x", token.replace("rz_job_", "rz_job_A")):
        with pytest.raises(CredentialError):
            creds.identify(forged)
    other = SharedSecretCredentials.from_file(tmp_path / "other")
    with pytest.raises(CredentialError):
        other.identify(token)


def test_metadata_without_a_bearer_credential_is_refused_saying_what_to_send(
    tmp_path: Path,
) -> None:
    creds = SharedSecretCredentials.from_file(tmp_path / "s")
    for metadata in ((), (("authorization", "Basic abc"),), (("authorization", "Bearer "),)):
        with pytest.raises(CredentialError) as info:
            creds.caller(metadata)
        assert "internal.secret" in str(info.value)
    assert creds.caller((("authorization", f"Bearer {creds.service_token()}"),)).is_service
