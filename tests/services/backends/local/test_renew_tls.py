"""The local backend renews a running job's TDS client certificate (issue #15) into each
learner's directory, never through a link a learner planted there: a planted link makes
the renewal a BackendError naming the learner (what the guardian expects of a backend),
not an unexpected exception out of the guardian's loop."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from contract.credentials import TDS_TLS_FILE
from services.backends.api import BackendError
from services.backends.local.backend import LocalBackend
from services.backends.local.isolation import IsolationConfig
from tests.services.backends.test_local import spec

RENEWED = {"ca": "CA PEM", "cert": "CERT PEM", "key": "KEY PEM"}


def backend() -> LocalBackend:
    return LocalBackend(isolation_config=IsolationConfig(None))  # no learner uid: any user


def test_a_renewal_lands_in_every_learner_directory(tmp_path: Path) -> None:
    job = spec(tmp_path)  # three learners
    Path(job.job_dir).mkdir(parents=True)  # prepare_volume made it
    backend().renew_tls(job, RENEWED)
    for rank in range(3):
        path = Path(job.job_dir, "learners", str(rank), TDS_TLS_FILE)
        assert json.loads(path.read_text()) == RENEWED
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_learner_directory_replaced_by_a_link_fails_the_renewal_naming_the_learner(
    tmp_path: Path,
) -> None:
    job = spec(tmp_path)
    learners = Path(job.job_dir, "learners")
    learners.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (learners / "1").symlink_to(elsewhere)  # a learner's link to a directory not its own
    with pytest.raises(BackendError, match=r"job job-x: cannot renew learner 1's TDS certificate"):
        backend().renew_tls(job, RENEWED)
    assert not (elsewhere / TDS_TLS_FILE).exists()  # never written through the link
    assert json.loads((learners / "0" / TDS_TLS_FILE).read_text()) == RENEWED
