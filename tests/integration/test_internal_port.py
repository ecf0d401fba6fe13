"""The internal services are off the public port and take a credential, against a real
daemon hosting every service over the real etcd, MongoDB-wire and Elasticsearch-API
servers: LifecycleManager, TrainingData and Scheduler are UNIMPLEMENTED on the public
port; on the internal port a call without the service credential, or with a wrong one,
is UNAUTHENTICATED; a job token appends to and reads its own job only."""

from __future__ import annotations

import contextlib
import stat
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from rhizome.v1 import (
    lcm_pb2,
    lcm_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tds_pb2,
    tds_pb2_grpc,
)

from contract.credentials import with_bearer
from services.client.sdk import ClientError
from services.daemon import Daemon
from services.embedded.process import ManagedServer
from services.security.internal import SharedSecretCredentials
from tests.daemons import running_daemon, start_daemon

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def daemon(
    etcd_server: ManagedServer,
    mongo_server: ManagedServer,
    es_server: ManagedServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Daemon]:
    with running_daemon(
        Path(tmp_path_factory.mktemp("internal")),
        mongo_server,
        database="internal_port",
        etcd=etcd_server,
        es=es_server,
        services=("api", "scheduler", "lcm", "tds"),
    ) as running:
        yield running


def internal_calls(channel: grpc.Channel) -> dict[str, object]:
    """One harmless call per internal service, keyed by service."""
    job = f"no-such-{uuid.uuid4().hex[:6]}"
    return {
        "LifecycleManager": lambda: lcm_pb2_grpc.LifecycleManagerStub(channel).HaltJob(
            lcm_pb2.LcmJobRequest(job_id=job, reason="test"), timeout=10
        ),
        "TrainingData": lambda: tds_pb2_grpc.TrainingDataStub(channel).CountStored(
            tds_pb2.CountStoredRequest(job_id=job, learner=0), timeout=10
        ),
        "Scheduler": lambda: scheduler_pb2_grpc.SchedulerStub(channel).GetCluster(
            scheduler_pb2.GetClusterRequest(), timeout=10
        ),
    }


def code_of(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    code: grpc.StatusCode = info.value.code()
    return code


def test_internal_services_are_unimplemented_on_the_public_port(daemon: Daemon) -> None:
    with grpc.insecure_channel(daemon.config.grpc_address) as channel:
        service_token = daemon.credentials.service_token()
        for name, call in internal_calls(with_bearer(channel, service_token)).items():
            assert code_of(call) == grpc.StatusCode.UNIMPLEMENTED, name
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        answer = next(
            iter(
                refl.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
                )
            )
        )
        listed = {s.name for s in answer.list_services_response.service}
        assert listed == {
            "rhizome.v1.Trainer",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        }


def test_the_internal_port_is_on_loopback_and_not_the_public_port(daemon: Daemon) -> None:
    host, _, port = daemon.config.internal_address.rpartition(":")
    assert host == "127.0.0.1"
    assert int(port) == daemon.internal_port != daemon.port


def test_an_internal_call_without_a_credential_is_unauthenticated(daemon: Daemon) -> None:
    with grpc.insecure_channel(daemon.config.internal_address) as channel:
        for name, call in internal_calls(channel).items():
            with pytest.raises(grpc.RpcError) as info:
                call()  # type: ignore[operator]
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert "internal.secret" in (info.value.details() or ""), name


def test_an_internal_call_with_a_wrong_credential_is_unauthenticated(daemon: Daemon) -> None:
    other = SharedSecretCredentials("rz_svc_" + "x" * 43)
    wrong = [
        other.service_token(),  # another daemon's secret
        "rz_" + "y" * 43,  # a user's API token
        other.job_token("some-job"),  # a job token signed with another secret
    ]
    with grpc.insecure_channel(daemon.config.internal_address) as raw:
        for token in wrong:
            for name, call in internal_calls(with_bearer(raw, token)).items():
                assert code_of(call) == grpc.StatusCode.UNAUTHENTICATED, (name, token[:8])


def test_the_service_credential_is_accepted_and_lives_in_a_0600_file(daemon: Daemon) -> None:
    secret_file = daemon.config.internal_secret_path
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    token = secret_file.read_text().strip()
    with grpc.insecure_channel(daemon.config.internal_address) as raw:
        channel = with_bearer(raw, token)
        calls = internal_calls(channel)
        calls["Scheduler"]()  # type: ignore[operator]
        calls["TrainingData"]()  # type: ignore[operator]
        # Authenticated, so the LCM itself answers: it refuses to halt a job it lacks.
        answer = calls["LifecycleManager"]()  # type: ignore[operator]
        assert isinstance(answer, lcm_pb2.LcmResponse) and not answer.accepted


def _line(job_id: str, seq: int, text: str) -> tds_pb2.LogLine:
    return tds_pb2.LogLine(job_id=job_id, learner=0, stream="stdout", seq=seq, line=text)


def test_a_job_token_cannot_write_or_read_another_jobs_logs(daemon: Daemon) -> None:
    mine, theirs = f"job-a-{uuid.uuid4().hex[:6]}", f"job-b-{uuid.uuid4().hex[:6]}"
    token = daemon.credentials.job_token(mine)
    with grpc.insecure_channel(daemon.config.internal_address) as raw:
        tds = tds_pb2_grpc.TrainingDataStub(with_bearer(raw, token))
        ok = tds.AddLogLines(tds_pb2.AddLogLinesRequest(lines=[_line(mine, 0, "mine")]), timeout=10)
        assert ok.accepted == 1
        for lines in ([_line(theirs, 0, "forged")], [_line(mine, 1, "x"), _line(theirs, 1, "y")]):
            with pytest.raises(grpc.RpcError) as info:
                tds.AddLogLines(tds_pb2.AddLogLinesRequest(lines=lines), timeout=10)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert theirs in (info.value.details() or "")
        sample = tds_pb2.MetricSample(job_id=theirs, learner=0, name="loss", source="logger")
        with pytest.raises(grpc.RpcError) as info:
            tds.AddMetrics(tds_pb2.AddMetricsRequest(samples=[sample]), timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as info:
            list(tds.GetLogs(tds_pb2.LogsRequest(job_id=theirs, learner=-1), timeout=10))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as info:
            tds.DeleteJobData(tds_pb2.DeleteJobDataRequest(job_id=mine), timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # Its own job reads back; the other job holds nothing of what was tried.
        own = list(tds.GetLogs(tds_pb2.LogsRequest(job_id=mine, learner=-1), timeout=10))
        assert [ln.line for ln in own] == ["mine"]
        service = tds_pb2_grpc.TrainingDataStub(
            with_bearer(raw, daemon.credentials.service_token())
        )
        assert (
            list(service.GetLogs(tds_pb2.LogsRequest(job_id=theirs, learner=-1), timeout=10)) == []
        )


def test_a_job_token_cannot_call_the_lifecycle_manager_or_the_scheduler(daemon: Daemon) -> None:
    token = daemon.credentials.job_token(f"job-{uuid.uuid4().hex[:6]}")
    with grpc.insecure_channel(daemon.config.internal_address) as raw:
        calls = internal_calls(with_bearer(raw, token))
        assert code_of(calls["LifecycleManager"]) == grpc.StatusCode.PERMISSION_DENIED
        assert code_of(calls["Scheduler"]) == grpc.StatusCode.PERMISSION_DENIED


def test_the_trainer_still_reaches_the_internal_services(daemon: Daemon) -> None:
    """The public API's own calls to the scheduler and the TDS carry the credential."""
    from tests.integration.conftest import token_client

    with token_client(daemon, f"u-{uuid.uuid4().hex[:6]}") as rz:
        job_id = rz.create_job("name: internal\nframework: {command: 'true'}\n").job_id
        assert rz.get_job(job_id).job_id == job_id
        # Both proxied through the Trainer to the internal port: an UNAVAILABLE or
        # UNAUTHENTICATED from there would raise here.
        assert list(rz.logs(tds_pb2.LogsRequest(job_id=job_id, learner=-1))) == []
        assert len(rz.cluster().nodes) > 0


def test_a_learner_ships_its_logs_with_its_own_job_token_which_is_never_logged(
    daemon: Daemon,
) -> None:
    """The whole path: the LCM issues the token to the guardian, the guardian writes it in
    the learner spec (0600), the collector sends it, the TDS stores the lines."""
    import json
    import time

    from rhizome.v1 import job_pb2

    from tests.integration.conftest import token_client

    with token_client(daemon, f"u-{uuid.uuid4().hex[:6]}") as rz:
        job_id = rz.create_job(
            "name: token-path\nframework: {command: 'echo hello-from-the-learner'}\n"
        ).job_id
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            status = rz.get_job(job_id).status
            if status in (job_pb2.COMPLETED, job_pb2.FAILED):
                break
            time.sleep(0.3)
        assert rz.get_job(job_id).status == job_pb2.COMPLETED
        lines = [ln.line for ln in rz.logs(tds_pb2.LogsRequest(job_id=job_id, learner=-1))]
        assert "hello-from-the-learner" in lines
    job_dir = daemon.config.jobs_dir / job_id
    spec_file = job_dir / "learners" / "0" / "spec.json"
    token = daemon.credentials.job_token(job_id)
    assert json.loads(spec_file.read_text())["tds_token"] == token
    assert stat.S_IMODE(spec_file.stat().st_mode) == 0o600
    secret = token.split(".", 1)[0]
    for log_file in job_dir.rglob("*.log"):
        assert secret not in log_file.read_text(errors="replace"), log_file


@contextlib.contextmanager
def tds_api_and_stranger(
    start: Callable[..., Daemon], ours: Path, theirs: Path
) -> Iterator[tuple[Daemon, Daemon, Daemon]]:
    """Three daemons, each `start(name, services, shared, **extra)`: the TDS alone, an API
    reading logs from it that shares `ours` with it (a secret or a CA directory), and a
    stranger API pointed at the same TDS with `theirs`; stopped newest first."""
    tds = start("tds", ("tds",), ours)
    started = [tds]
    try:
        peer = {"tds": tds.config.internal_address}
        started.append(start("api", ("api",), ours, peers=peer))
        started.append(start("stranger", ("api",), theirs, peers=peer))
        yield tds, started[1], started[2]
    finally:
        for d in reversed(started):
            d.stop()


def test_daemons_reach_each_others_internal_port_with_the_shared_secret_only(
    mongo_server: ManagedServer, es_server: ManagedServer, tmp_path: Path
) -> None:
    """The API in one daemon, the TDS in another: the API's calls cross the wire to the
    TDS's internal port with the secret both were given; a daemon with its own secret is
    refused there."""
    from tests.integration.conftest import token_client

    uri = mongo_server.url.replace("/?", "/internal_peers?")

    def daemon(name: str, services: tuple[str, ...], secret: Path, **extra: object) -> Daemon:
        (tmp_path / name).mkdir()
        return start_daemon(
            tmp_path / name,
            uri,
            es=es_server,
            services=services,
            internal_secret_file=str(secret),
            **extra,
        )

    shared, other = tmp_path / "shared.secret", tmp_path / "other.secret"
    with tds_api_and_stranger(daemon, shared, other) as (tds, api, stranger):
        with token_client(api, "peer-admin", role="admin") as rz:
            job_id = rz.create_job("name: peer\nframework: {command: 'true'}\n").job_id
            line = tds_pb2.LogLine(job_id=job_id, learner=0, stream="stdout", seq=0, line="hi")
            with grpc.insecure_channel(tds.config.internal_address) as raw:
                stub = tds_pb2_grpc.TrainingDataStub(
                    with_bearer(raw, tds.credentials.service_token())
                )
                stub.AddLogLines(tds_pb2.AddLogLinesRequest(lines=[line]), timeout=10)
            request = tds_pb2.LogsRequest(job_id=job_id, learner=-1)
            assert [ln.line for ln in rz.logs(request)] == ["hi"]
        with token_client(stranger, "peer-admin", role="admin") as rz:
            with pytest.raises(ClientError) as info:
                list(rz.logs(request))
            # The user's token is fine; the platform is misconfigured, and says so.
            assert info.value.code == "UNAVAILABLE"
            assert "wrong service credential" in info.value.message


def test_a_restarted_daemon_answers_on_the_same_internal_port(
    mongo_server: ManagedServer, tmp_path: Path
) -> None:
    """Running learners keep the TDS address they were deployed with."""

    def start() -> Daemon:
        return start_daemon(tmp_path, mongo_server, services=("api",))

    first = start()
    port = first.internal_port
    first.stop()
    second = start()
    try:
        assert second.internal_port == port
        assert second.config.internal_address == f"127.0.0.1:{port}"
    finally:
        second.stop()
