"""The guardian's renewal of a job's TDS certificate (unit: a stand-in backend): a backend
that cannot renew at all is asked once; a failed attempt is tried again later, not given
up on (the learners' logs would stop when the certificate expires)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from services.backends.api import BackendError, RenewalUnsupported
from services.guardian import guardian as guardian_module
from services.guardian.guardian import Guardian
from services.security.tls import ensure_certificates_in


class Backend:
    def __init__(self, *failures: Exception) -> None:
        self.failures = list(failures)
        self.calls = 0

    def renew_tls(self, job: Any, tls: dict[str, str]) -> None:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)


def stand_in(tmp_path: Path, backend: Backend) -> Any:
    ensure_certificates_in(tmp_path / "ca")  # a CA that issues job certificates
    config = SimpleNamespace(tds_tls_dir=str(tmp_path / "ca"), tds_tls=None)
    return SimpleNamespace(
        config=config,
        job_id="renew-1",
        backend=backend,
        _renewal_refused=False,
        _renewal_retry_at=0.0,
    )


def spec() -> Any:
    return SimpleNamespace(tds_tls={"cert": "unreadable: renewal due"})


def test_a_backend_that_cannot_renew_is_asked_once(tmp_path: Path) -> None:
    backend = Backend(RenewalUnsupported("cannot"))
    guardian, job = stand_in(tmp_path, backend), spec()
    for _ in range(3):
        Guardian.renew_job_certificate(guardian, job)
    assert backend.calls == 1


def test_a_failed_renewal_is_tried_again_after_the_retry_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(guardian_module.time, "monotonic", lambda: now[0])
    backend = Backend(BackendError("the cluster's API did not answer"))
    guardian, job = stand_in(tmp_path, backend), spec()
    Guardian.renew_job_certificate(guardian, job)
    Guardian.renew_job_certificate(guardian, job)  # within the interval: not asked
    assert backend.calls == 1
    now[0] += guardian_module.RENEWAL_RETRY_S
    Guardian.renew_job_certificate(guardian, job)
    assert backend.calls == 2
    assert "cert" in job.tds_tls and job.tds_tls["cert"].startswith("-----BEGIN")
    assert guardian.config.tds_tls == job.tds_tls
