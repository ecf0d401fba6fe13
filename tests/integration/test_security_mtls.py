"""Mutual TLS on the internal port of the embedded platform (`rhizome up`, TLS by default),
against the real daemon, etcd, MongoDB-wire and Elasticsearch-API servers: a job's
learner ships its logs to the TDS with the job's own client certificate (from its 0600
learner spec), and a caller without a certificate of the platform's CA is refused in the
handshake, whatever else it holds."""

from __future__ import annotations

import json
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rhizome.v1 import job_pb2, tds_pb2, tds_pb2_grpc

from contract.credentials import internal_channel, tls_channel_credentials, with_bearer
from services.client.sdk import Client
from services.daemon import INTERNAL_PORT_FILE
from services.embedded.platform import TlsChoice, load_state
from services.embedded.process import ManagedServer
from services.security.tls import (
    ensure_client_certificate,
    ensure_client_certificate_in,
    ensure_local_certificates,
    internal_channel_credentials,
)
from tests.daemons import start_daemon
from tests.integration.test_cli import embedded_up
from tests.integration.test_internal_port import tds_api_and_stranger

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with embedded_up(Path(tmp_path_factory.mktemp("mtls-embedded"))) as data_dir:
        yield data_dir


def internal_address(data_dir: Path) -> str:
    return f"127.0.0.1:{int((data_dir / INTERNAL_PORT_FILE).read_text())}"


def health(channel: grpc.Channel) -> grpc.StatusCode:
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()
    finally:
        channel.close()


def test_a_caller_without_a_certificate_of_the_platforms_ca_is_refused(
    embedded: Path, tmp_path: Path
) -> None:
    address = internal_address(embedded)
    ca = (embedded / "tls" / "ca.pem").read_bytes()
    secret = (embedded / "internal.secret").read_text().strip()
    # Plaintext, even with the service credential.
    assert (
        health(with_bearer(grpc.insecure_channel(address), secret)) == grpc.StatusCode.UNAVAILABLE
    )
    # TLS trusting the platform's CA, but no client certificate.
    no_cert = grpc.ssl_channel_credentials(root_certificates=ca)
    assert health(internal_channel(address, no_cert)) == grpc.StatusCode.UNAVAILABLE
    # A client certificate of another CA.
    other = tmp_path / "other"
    ensure_local_certificates(other)
    theirs = ensure_client_certificate(other, "intruder")
    foreign = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=theirs.key.read_bytes(),
        certificate_chain=theirs.cert.read_bytes(),
    )
    assert health(internal_channel(address, foreign)) == grpc.StatusCode.UNAVAILABLE
    # The daemon's own certificate gets through (and the service credential still counts).
    mine = internal_channel_credentials(ensure_client_certificate(embedded, "daemon"))
    assert health(internal_channel(address, mine)) == grpc.StatusCode.OK
    with with_bearer(internal_channel(address, mine), secret) as channel:
        stub = tds_pb2_grpc.TrainingDataStub(channel)
        assert stub.CountStored(tds_pb2.CountStoredRequest(job_id="nobody"), timeout=10) is not None


def test_a_job_ships_its_logs_over_mutual_tls_with_its_own_certificate(embedded: Path) -> None:
    state = load_state(embedded)
    assert state is not None and state.tls
    with Client(state.api_address, data_dir=embedded) as client:
        job_id = client.create_job(
            "name: mtls\nframework: {command: 'echo hello-over-mtls'}\n"
        ).job_id
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if client.get_job(job_id).status in (job_pb2.COMPLETED, job_pb2.FAILED):
                break
            time.sleep(0.3)
        assert client.get_job(job_id).status == job_pb2.COMPLETED
        lines = [ln.line for ln in client.logs(tds_pb2.LogsRequest(job_id=job_id, learner=-1))]
        assert "hello-over-mtls" in lines
    # The learner held a certificate of its own job, signed by the platform's CA, in its
    # 0600 spec; the guardian's log and the learner's logs do not repeat its key.
    spec_file = state_jobs(embedded) / job_id / "learners" / "0" / "spec.json"
    assert stat.S_IMODE(spec_file.stat().st_mode) == 0o600
    tls = json.loads(spec_file.read_text())["tds_tls"]
    cert = x509.load_pem_x509_certificate(tls["cert"].encode())
    ca = x509.load_pem_x509_certificate((embedded / "tls" / "ca.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == f"job-{job_id}"
    tls_channel_credentials(tls)  # well-formed
    key_body = tls["key"].splitlines()[1]
    for log_file in (state_jobs(embedded) / job_id).rglob("*.log"):
        assert key_body not in log_file.read_text(errors="replace"), log_file
    # No per-job certificate was left in the CA directory.
    assert not list((embedded / "tls").glob(f"job-{job_id}*"))


def state_jobs(data_dir: Path) -> Path:
    return data_dir / "jobs"


def test_plaintext_up_keeps_a_plaintext_internal_port() -> None:
    """`--insecure-plaintext` passes the daemon no TLS at all (the internal port included),
    today's behaviour; `up` with TLS passes the CA directory for the internal port."""
    assert TlsChoice(plaintext=True).daemon_args() == []
    served = TlsChoice(cert="/c.pem", key="/c.key", internal_dir="/data/tls").daemon_args()
    assert "--internal-tls-dir=/data/tls" in served


def test_daemons_reach_each_others_internal_port_over_mutual_tls(
    mongo_server: ManagedServer, es_server: ManagedServer, tmp_path: Path
) -> None:
    """The API in one daemon, the TDS in another, sharing the CA directory and the secret:
    the API's log reads cross the wire to the TDS's mutual-TLS port with the API daemon's
    certificate; a daemon with the right secret but another CA is refused there."""
    from services.client.sdk import ClientError
    from services.daemon import Daemon
    from tests.integration.conftest import token_client

    uri = mongo_server.url.replace("/?", "/mtls_peers?")
    secret = tmp_path / "shared.secret"

    def daemon(name: str, services: tuple[str, ...], ca_dir: Path, **extra: object) -> Daemon:
        (tmp_path / name).mkdir()
        return start_daemon(
            tmp_path / name,
            uri,
            es=es_server,
            services=services,
            internal_secret_file=str(secret),
            internal_tls_dir=str(ca_dir),
            **extra,
        )

    ours, theirs = tmp_path / "ca", tmp_path / "other-ca"
    with tds_api_and_stranger(daemon, ours, theirs) as (tds, api, stranger):
        with token_client(api, "mtls-admin", role="admin") as rz:
            job_id = rz.create_job("name: peer\nframework: {command: 'true'}\n").job_id
            line = tds_pb2.LogLine(job_id=job_id, learner=0, stream="stdout", seq=0, line="hi")
            mine = internal_channel_credentials(ensure_client_certificate_in(tmp_path / "ca"))
            with with_bearer(
                internal_channel(tds.config.internal_address, mine),
                tds.credentials.service_token(),
            ) as channel:
                stub = tds_pb2_grpc.TrainingDataStub(channel)
                stub.AddLogLines(tds_pb2.AddLogLinesRequest(lines=[line]), timeout=10)
            request = tds_pb2.LogsRequest(job_id=job_id, learner=-1)
            assert [ln.line for ln in rz.logs(request)] == ["hi"]
        with token_client(stranger, "mtls-admin", role="admin") as rz:
            with pytest.raises(ClientError) as info:
                list(rz.logs(request))
            assert info.value.code == "UNAVAILABLE"


def test_the_collector_process_takes_its_certificate_from_its_environment(
    embedded: Path, tmp_path: Path
) -> None:
    """`python -m learner.controller.collector` (and the docker backend's container-log
    helper, which reads the same variables): the job token and the job's certificate in
    its environment, never argv; it ships a learner's file over mutual TLS."""
    import os
    import subprocess
    import sys

    from contract.containers import COLLECTOR_TLS_ENV, COLLECTOR_TOKEN_ENV
    from services.security.internal import SharedSecretCredentials
    from services.security.tls import InternalTls

    job_id = "job-collector-process-mtls"
    learner = tmp_path / "job" / "learners" / "0"
    learner.mkdir(parents=True)
    (learner / "stdout.log").write_text("from-the-collector-process\n")
    (learner / "stderr.log").write_text("")
    secret = SharedSecretCredentials.from_file(embedded / "internal.secret", create=False)
    argv = [
        sys.executable,
        "-m",
        "learner.controller.collector",
        f"--job-id={job_id}",
        "--learner=0",
        f"--job-dir={tmp_path / 'job'}",
        f"--tds={internal_address(embedded)}",
        "--verify-interval-s=0",
        "--once",
    ]
    env = {**os.environ, COLLECTOR_TOKEN_ENV: secret.job_token(job_id)}
    # Without the certificate the handshake fails: nothing is shipped. The collector
    # retries until its drain time-out, so the refused run gets a short one (the
    # handshake fails at once; 20 s of retries showed nothing more).
    refused = subprocess.run(
        [*argv, "--drain-timeout-s=3"], env=env, capture_output=True, text=True, timeout=120
    )
    assert refused.returncode != 0
    assert "collector stopped before its data was shipped" in refused.stderr, refused.stderr
    assert "UNAVAILABLE" in refused.stderr, refused.stderr
    env[COLLECTOR_TLS_ENV] = json.dumps(InternalTls(embedded / "tls").job_credentials(job_id))
    shipped = subprocess.run(
        [*argv, "--drain-timeout-s=20"], env=env, capture_output=True, text=True, timeout=120
    )
    assert shipped.returncode == 0, shipped.stderr
    mine = internal_channel_credentials(ensure_client_certificate(embedded, "daemon"))
    with with_bearer(
        internal_channel(internal_address(embedded), mine), secret.service_token()
    ) as channel:
        stub = tds_pb2_grpc.TrainingDataStub(channel)
        got = stub.GetLogs(tds_pb2.LogsRequest(job_id=job_id, learner=-1), timeout=20)
        assert "from-the-collector-process" in [line.line for line in got]
