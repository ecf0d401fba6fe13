"""The LCM hands a guardian its store URIs in its environment, not on its command line:
/proc/PID/cmdline is readable by every local user (a learner uid included), and a store
URI may carry a password. A real daemon (API, scheduler, LCM, TDS) over the real etcd,
MongoDB-wire and Elasticsearch-API servers, with a password in its etcd URL; the job's
guardian and learners are read back from /proc."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from rhizome.v1 import job_pb2

from services.daemon import Daemon
from services.embedded.process import ManagedServer
from services.security.api import (
    GUARDIAN_ETCD_URL_ENV,
    GUARDIAN_MONGODB_URI_ENV,
    GUARDIAN_SERVICE_TOKEN_ENV,
)
from tests.daemons import running_daemon
from tests.integration.conftest import token_client
from tests.services.guardian.helpers import wait_for

pytestmark = pytest.mark.integration

PASSWORD = "Hunter2-guardian-s3cret"


@pytest.fixture(scope="module")
def daemon(
    etcd_server: ManagedServer,
    mongo_server: ManagedServer,
    es_server: ManagedServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Daemon]:
    # The etcd client takes host and port from the URL and ignores its userinfo, so the
    # password rides along as it would in a deployment's URL.
    etcd_url = etcd_server.url.replace("://", f"://rzuser:{PASSWORD}@", 1)
    with running_daemon(
        Path(tmp_path_factory.mktemp("guardian-argv")),
        mongo_server,
        database="guardian_argv",
        etcd=etcd_url,
        es=es_server,
        services=("api", "scheduler", "lcm", "tds"),
    ) as running:
        yield running


def _processes() -> Iterator[tuple[int, bytes]]:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                yield int(entry.name), (entry / "cmdline").read_bytes()
            except OSError:  # it exited while we looked
                continue


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for other, _ in _processes():
        try:
            stat = (Path("/proc") / str(other) / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(other)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def test_a_guardians_command_line_holds_no_store_uri_and_its_learners_inherit_none(
    daemon: Daemon,
) -> None:
    with token_client(daemon, f"u-{uuid.uuid4().hex[:6]}") as rz:
        job_id = rz.create_job(
            "name: argv\nframework: {command: 'echo started; sleep 60'}\n"
        ).job_id
        marker = f"--job-id={job_id}".encode()

        lcm = daemon.ctx.shared["lcm"]

        def guardian() -> tuple[int, bytes] | None:
            # A guardian process names its job; a guardian host (--guardians-per-host)
            # names none: it is the process the LCM gave the job to.
            supervised = lcm.guardians.get(job_id)
            hosted = {supervised.ref.pid} if supervised and supervised.host else set()
            return next(
                (
                    (pid, cmd)
                    for pid, cmd in _processes()
                    if b"services.guardian" in cmd and (marker in cmd or pid in hosted)
                ),
                None,
            )

        pid, cmdline = wait_for(f"job {job_id}'s guardian", guardian, 90)
        # The guardian works with the URIs it was given (it got the job running)...
        wait_for(
            f"job {job_id} PROCESSING",
            lambda: rz.get_job(job_id).status == job_pb2.PROCESSING,
            90,
        )
        # ...and none of them is on its command line, the password least of all.
        argv = cmdline.decode(errors="replace")
        assert PASSWORD not in argv
        assert "--etcd" not in argv and "--mongodb-uri" not in argv
        assert daemon.config.mongodb_uri not in argv
        # The scheduler's address (a lost pipeline learner's replacement is placed there)
        # is on it; the service credential for it is not.
        assert f"--scheduler={daemon.config.internal_address}" in argv, argv
        assert daemon.credentials is not None
        service_token = daemon.credentials.service_token()
        assert service_token not in argv
        # What the guardian starts (the learner's controller and command) does not inherit
        # them either: the guardian pops them from its environment.
        learners = wait_for(f"job {job_id}'s learner processes", lambda: _descendants(pid), 90)
        for child in learners:
            try:
                environ = (Path("/proc") / str(child) / "environ").read_bytes()
                child_cmd = (Path("/proc") / str(child) / "cmdline").read_bytes()
            except OSError:
                continue  # it exited
            assert PASSWORD.encode() not in environ + child_cmd, child
            assert GUARDIAN_ETCD_URL_ENV.encode() not in environ, child
            assert GUARDIAN_MONGODB_URI_ENV.encode() not in environ, child
            assert GUARDIAN_SERVICE_TOKEN_ENV.encode() not in environ, child
            assert service_token.encode() not in environ + child_cmd, child
        rz.delete_job(job_id)
