"""Short-lived job certificates on the internal port (issue #15), against a real daemon
serving its TDS over mutual TLS (the real MongoDB-wire and Elasticsearch-API servers): a
job certificate is valid 24 h, an expired one is refused in the handshake, and a
learner's TDS stub follows a renewed certificate the guardian writes (`tds-tls.json`)
without being restarted, retried calls included."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from rhizome.v1 import tds_pb2

from learner.controller.tds_channel import RenewingStub
from services.daemon import Daemon
from services.embedded.process import ManagedServer
from services.security.tls import JOB_CERT_VALID, InternalTls, renewal_due
from tests.services.tds.helpers import mutual_tls_tds

pytestmark = pytest.mark.integration

JOB = "job-certs-1"


@pytest.fixture(scope="module")
def tds(
    mongo_server: ManagedServer, es_server: ManagedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Daemon, InternalTls, str]]:
    data_dir = Path(tmp_path_factory.mktemp("job-certs"))
    with mutual_tls_tds(mongo_server.url, es_server.url, data_dir, "job_certs", JOB) as running:
        yield running


def count(stub: object) -> grpc.StatusCode:
    try:
        stub.CountStored(  # type: ignore[attr-defined]
            tds_pb2.CountStoredRequest(job_id=JOB, learner=0), timeout=10
        )
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def test_a_job_certificate_is_valid_24_hours_and_due_for_renewal_at_half_life(
    tds: tuple[Daemon, InternalTls, str],
) -> None:
    _, ca, _ = tds
    tls = ca.job_credentials(JOB)
    cert = x509.load_pem_x509_certificate(tls["cert"].encode())
    # Valid from 5 minutes ago (clocks drift) for 24 h from now: not the daemon's 397 days.
    slack = datetime.timedelta(minutes=5)
    assert cert.not_valid_after_utc - cert.not_valid_before_utc <= JOB_CERT_VALID + slack
    assert not renewal_due(tls)
    issued = cert.not_valid_before_utc + slack
    half = issued + (cert.not_valid_after_utc - issued) / 2
    assert not renewal_due(tls, now=half - datetime.timedelta(seconds=1))
    assert renewal_due(tls, now=half + datetime.timedelta(seconds=1))


@pytest.mark.parametrize("backend,short", [("local", True), ("docker", True), ("kubernetes", True)])
def test_the_lcm_issues_24_hour_certificates_where_the_backend_renews_them(
    tds: tuple[Daemon, InternalTls, str], backend: str, short: bool
) -> None:
    """Local, docker and kubernetes learners get their next certificate while they run
    (`renews_tls`; kubernetes through the job's TLS Secret volume): 24 h."""
    from services.lcm.hosting import _job_certificates

    _, ca, _ = tds
    cert = x509.load_pem_x509_certificate(_job_certificates(ca, backend)(JOB)["cert"].encode())
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    slack = datetime.timedelta(minutes=5)
    assert (lifetime <= JOB_CERT_VALID + slack) is short, (backend, lifetime)


def test_an_expired_job_certificate_is_refused_and_a_renewed_one_is_followed(
    tds: tuple[Daemon, InternalTls, str], tmp_path: Path
) -> None:
    daemon, ca, token = tds
    address = daemon.config.internal_address
    expired = ca.job_credentials(JOB, valid=datetime.timedelta(minutes=-1))
    renewed_file = tmp_path / "tds-tls.json"
    stub = RenewingStub(address, token, expired, renewed_file)
    stub.CHECK_INTERVAL_S = 0.0  # type: ignore[misc]  # look for the file on every call
    try:
        # Expired (signed by the right CA, with the right token): refused in the handshake.
        assert count(stub) == grpc.StatusCode.UNAVAILABLE
        # The guardian writes the next certificate: the same stub object now gets through.
        renewed_file.write_text(json.dumps(ca.job_credentials(JOB)))
        assert count(stub) == grpc.StatusCode.OK
    finally:
        stub.close()
