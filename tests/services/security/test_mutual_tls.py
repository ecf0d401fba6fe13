"""Mutual TLS for the internal port (services/security/tls.py), on a real gRPC server
serving health with `internal_server_credentials`: only a client presenting a certificate
of the platform's CA gets through the handshake."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.security.api import TlsError
from services.security.tls import (
    ensure_client_certificate,
    ensure_local_certificates,
    internal_channel_credentials,
    internal_server_credentials,
)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    data_dir = tmp_path / "platform"
    files = ensure_local_certificates(data_dir)
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), srv)
    port = srv.add_secure_port("127.0.0.1:0", internal_server_credentials(files))
    srv.start()
    try:
        yield f"localhost:{port}", data_dir
    finally:
        srv.stop(0)


def check(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    channel = (
        grpc.secure_channel(address, credentials)
        if credentials is not None
        else grpc.insecure_channel(address)
    )
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()
    finally:
        channel.close()


def test_a_client_with_a_certificate_of_the_platforms_ca_gets_through(
    server: tuple[str, Path],
) -> None:
    address, data_dir = server
    client = ensure_client_certificate(data_dir, "daemon")
    assert stat.S_IMODE(client.key.stat().st_mode) == 0o600
    assert check(address, internal_channel_credentials(client)) == grpc.StatusCode.OK


def test_a_client_without_a_certificate_is_refused(server: tuple[str, Path]) -> None:
    address, data_dir = server
    ca = (data_dir / "tls" / "ca.pem").read_bytes()
    only_trust = grpc.ssl_channel_credentials(root_certificates=ca)
    assert check(address, only_trust) == grpc.StatusCode.UNAVAILABLE
    assert check(address, None) == grpc.StatusCode.UNAVAILABLE  # plaintext


def test_a_certificate_of_another_ca_is_refused(server: tuple[str, Path], tmp_path: Path) -> None:
    address, data_dir = server
    other_dir = tmp_path / "other-platform"
    ensure_local_certificates(other_dir)
    stranger = ensure_client_certificate(other_dir, "daemon")
    ca = (data_dir / "tls" / "ca.pem").read_bytes()
    # It trusts the right server, but presents a certificate our CA did not sign.
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=stranger.key.read_bytes(),
        certificate_chain=stranger.cert.read_bytes(),
    )
    assert check(address, credentials) == grpc.StatusCode.UNAVAILABLE


def test_client_certificates_are_reused_and_need_a_ca(tmp_path: Path) -> None:
    with pytest.raises(TlsError, match="no usable CA"):
        ensure_client_certificate(tmp_path, "daemon")
    ensure_local_certificates(tmp_path)
    first = ensure_client_certificate(tmp_path, "job-1").cert.read_bytes()
    assert ensure_client_certificate(tmp_path, "job-1").cert.read_bytes() == first
    with pytest.raises(TlsError, match="letters, digits"):
        ensure_client_certificate(tmp_path, "../x")


def test_a_jobs_in_memory_certificate_gets_through_dialled_by_ip(
    server: tuple[str, Path],
) -> None:
    """What a learner's collector does: its job's PEM text from the spec, dialling the
    internal port by IP (the name is checked as `localhost`, which the server holds)."""
    from contract.credentials import internal_channel, tls_channel_credentials
    from services.security.tls import InternalTls

    address, data_dir = server
    tls = InternalTls.open(data_dir / "tls").job_credentials("job-42")
    assert set(tls) == {"ca", "cert", "key"}
    assert not list((data_dir / "tls").glob("job-job-42*"))  # nothing written
    channel = internal_channel(
        address.replace("localhost", "127.0.0.1"), tls_channel_credentials(tls)
    )
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        channel.close()
    with pytest.raises(ValueError, match="key"):
        tls_channel_credentials({"ca": tls["ca"], "cert": tls["cert"]})
