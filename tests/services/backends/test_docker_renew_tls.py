"""The docker backend renews a running job's TDS client certificate (issue #15), as the
local backend does: `tds-tls.json` lands where the job's log collector (a host process)
and each learner's controller (in its container, which mounts the learner directory at
the same path) re-read it, never through a link a learner planted. No engine is needed:
the files are the whole hand-over (the collector's re-reading is tested in
tests/integration/test_security_job_certs.py)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from contract.credentials import TDS_TLS_FILE
from contract.env import learner_dir
from services.backends.api import BackendError
from services.backends.docker.backend import DockerBackend
from tests.services.backends.test_docker_spec import job

RENEWED = {"ca": "CA PEM", "cert": "CERT PEM", "key": "KEY PEM"}


def test_a_renewal_reaches_the_collector_and_every_learner(tmp_path: Path) -> None:
    backend = DockerBackend(docker_host=f"unix://{tmp_path}/nothing.sock")
    spec = job(tmp_path)  # two learners
    learner_1 = Path(spec.job_dir, "learners", "1")
    learner_1.mkdir(parents=True)
    planted = tmp_path / "elsewhere.json"
    planted.write_text("not yours")
    (learner_1 / TDS_TLS_FILE).symlink_to(planted)  # a learner's link is replaced

    backend.renew_tls(spec, RENEWED)

    helper = backend.helper_dir(spec.job_dir)
    for rank in (0, 1):
        # Where the collector of that rank (container_logs.py: a Collector over the
        # helper directory) and the learner's controller (over the job's) look.
        collectors = learner_dir(helper, rank) / TDS_TLS_FILE
        learners = learner_dir(spec.job_dir, rank) / TDS_TLS_FILE
        for path in (collectors, learners):
            assert not path.is_symlink()
            assert json.loads(path.read_text()) == RENEWED
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
        if os.getuid() == 0:  # learners run as the image's uid: their file is theirs
            assert learners.stat().st_uid == backend.options.uid
            assert collectors.stat().st_uid == 0  # the collector is the daemon's process
    assert planted.read_text() == "not yours"


def test_a_renewal_that_cannot_be_written_says_which_part(tmp_path: Path) -> None:
    backend = DockerBackend(docker_host=f"unix://{tmp_path}/nothing.sock")
    spec = job(tmp_path)
    Path(spec.job_dir).mkdir(parents=True)
    (Path(spec.job_dir) / "learners").write_text("a file where a directory belongs")
    with pytest.raises(BackendError, match="cannot renew learner 0's TDS certificate"):
        backend.renew_tls(spec, RENEWED)
