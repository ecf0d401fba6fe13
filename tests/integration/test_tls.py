"""TLS on the public ports, against the real servers: the embedded platform serves gRPC
and REST over TLS by default with a CA and certificate it generated, the CLI works with
no extra flag, plaintext clients are refused; a daemon serves your own certificate, and
a bad one stops it with the reason."""

from __future__ import annotations

import json
import ssl
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.client.sdk import Client, ClientError
from services.embedded.platform import load_state
from services.embedded.process import ManagedServer
from services.security.api import TlsError
from services.security.tls import TlsFiles, ensure_local_certificates
from tests.integration.conftest import RunningApi, start_api
from tests.integration.test_cli import RHIZOME, rz

pytestmark = pytest.mark.integration


# -- the generated certificates ------------------------------------------------------------
def test_local_certificates_are_generated_once_with_private_keys_0600(tmp_path: Path) -> None:
    files = ensure_local_certificates(tmp_path)
    assert files.ca is not None
    for key in (files.key, files.ca.with_name("ca.key")):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    assert "127.0.0.1" in {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    before = files.cert.read_bytes(), files.ca.read_bytes()
    again = ensure_local_certificates(tmp_path)
    assert again.ca is not None
    assert (again.cert.read_bytes(), again.ca.read_bytes()) == before  # reused, not renewed


def test_a_broken_server_certificate_is_replaced_under_the_same_ca(tmp_path: Path) -> None:
    files = ensure_local_certificates(tmp_path)
    assert files.ca is not None
    ca_before = files.ca.read_bytes()
    files.cert.write_text("not a certificate\n")
    again = ensure_local_certificates(tmp_path)
    assert again.ca is not None and again.ca.read_bytes() == ca_before
    x509.load_pem_x509_certificate(again.cert.read_bytes()).verify_directly_issued_by(
        x509.load_pem_x509_certificate(ca_before)
    )


def test_a_key_of_another_certificate_is_refused_naming_both(tmp_path: Path) -> None:
    one = ensure_local_certificates(tmp_path / "one")
    two = ensure_local_certificates(tmp_path / "two")
    with pytest.raises(TlsError) as info:
        TlsFiles(one.cert, two.key).load()
    assert str(one.cert) in str(info.value) and str(two.key) in str(info.value)
    with pytest.raises(TlsError) as info:
        TlsFiles(tmp_path / "missing.pem", two.key).load()
    assert "missing.pem" in str(info.value)


# -- a daemon with your own certificate ----------------------------------------------------
@pytest.fixture(scope="module")
def tls_api(
    mongo_server: ManagedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RunningApi, TlsFiles]]:
    data_dir = Path(tmp_path_factory.mktemp("tls-api"))
    files = ensure_local_certificates(data_dir / "mine")
    running = start_api(
        mongo_server.url, data_dir, tls_cert=str(files.cert), tls_key=str(files.key)
    )
    try:
        yield running, files
    finally:
        running.daemon.stop()


def test_a_client_trusting_the_ca_works_over_grpc_and_rest(
    tls_api: tuple[RunningApi, TlsFiles],
) -> None:
    api, files = tls_api
    assert files.ca is not None
    with Client(api.grpc, token=api.token("tls-user"), ca_file=files.ca) as rz_client:
        assert rz_client.tls
        job = rz_client.create_job("name: tls\nframework: {command: 'true'}\n")
        assert rz_client.get_job(job.job_id).job_id == job.job_id
    context = ssl.create_default_context(cafile=str(files.ca))
    rest = api.rest.replace("http://", "https://")
    answer = httpx.get(f"{rest}/v1/models", headers=api.headers("tls-user"), verify=context)
    assert answer.status_code == 200
    assert [m["model_id"] for m in answer.json()["models"]] == [job.job_id]


def test_a_plaintext_client_is_refused(tls_api: tuple[RunningApi, TlsFiles]) -> None:
    api, _ = tls_api
    with grpc.insecure_channel(api.grpc) as channel:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{api.rest}/healthz", timeout=5)  # http:// to the TLS port


def test_a_client_that_does_not_trust_the_certificate_is_told_how_to_fix_it(
    tls_api: tuple[RunningApi, TlsFiles], tmp_path: Path
) -> None:
    api, _ = tls_api
    stranger = ensure_local_certificates(tmp_path)  # another CA
    client = Client(api.grpc, token=api.token("tls-user"), ca_file=stranger.ca, timeout_s=5)
    with client, pytest.raises(ClientError) as info:
        client.list_jobs()
    assert info.value.code == "UNAVAILABLE"
    assert "--tls-ca" in info.value.message


def test_the_daemon_refuses_a_certificate_without_its_key_in_one_line(
    mongo_server: ManagedServer, tmp_path: Path
) -> None:
    one = ensure_local_certificates(tmp_path / "one")
    two = ensure_local_certificates(tmp_path / "two")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.daemon",
            "--services=api",
            f"--data-dir={tmp_path / 'data'}",
            f"--mongodb-uri={mongo_server.url}",
            "--grpc-address=127.0.0.1:0",
            "--rest-address=127.0.0.1:0",
            f"--tls-cert={one.cert}",
            f"--tls-key={two.key}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "does not belong to the certificate" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- the embedded platform -----------------------------------------------------------------
@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    data_dir = Path(tmp_path_factory.mktemp("tls-embedded"))
    rz(data_dir, "up", "--embedded", "--grpc-port", "0", "--rest-port", "0")
    try:
        yield data_dir
    finally:
        rz(data_dir, "down", check=False)


def test_the_embedded_platform_serves_tls_by_default(embedded: Path) -> None:
    state = load_state(embedded)
    assert state is not None and state.tls
    assert Path(state.tls_ca) == embedded / "tls" / "ca.pem"
    assert state.rest_url.startswith("https://")
    context = ssl.create_default_context(cafile=state.tls_ca)
    assert httpx.get(f"{state.rest_url}/healthz", verify=context).status_code == 200
    with grpc.insecure_channel(state.api_address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_cli_and_sdk_need_no_flag_to_use_it(embedded: Path) -> None:
    state = load_state(embedded)
    assert state is not None
    listed = json.loads(rz(embedded, "list", "--json").stdout)
    assert isinstance(listed, list)
    status = json.loads(rz(embedded, "status", "--json").stdout)
    assert status["components"]["api"]["serving"] is True
    with Client(state.api_address, data_dir=embedded) as client:
        assert client.tls
        client.list_jobs()


def test_the_cli_told_to_use_plaintext_fails_with_a_clear_error(embedded: Path) -> None:
    proc = rz(embedded, "--insecure-plaintext", "list", check=False)
    assert proc.returncode == 1
    assert "error:" in proc.stderr and "Traceback" not in proc.stderr


def test_up_serves_your_own_certificate_and_the_cli_trusts_your_ca(tmp_path: Path) -> None:
    mine = ensure_local_certificates(tmp_path / "mine")  # stands in for a CA of yours
    assert mine.ca is not None
    data_dir = tmp_path / "data"
    flags = ["--tls-cert", str(mine.cert), "--tls-key", str(mine.key), "--tls-ca", str(mine.ca)]
    rz(data_dir, "up", "--embedded", "--grpc-port", "0", "--rest-port", "0", *flags)
    try:
        state = load_state(data_dir)
        assert state is not None and state.tls and state.tls_ca == str(mine.ca)
        # The public ports serve yours (the CLI trusting your CA lists below); the only
        # CA generated is the internal port's, for mutual TLS among the platform's own
        # processes (docs/security.md).
        assert (data_dir / "tls" / "ca.pem").exists()
        assert json.loads(rz(data_dir, "list", "--json").stdout) == []
    finally:
        rz(data_dir, "down", check=False)


def test_up_refuses_contradicting_tls_flags(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            *RHIZOME,
            "--data-dir",
            str(tmp_path),
            "up",
            "--embedded",
            "--insecure-plaintext",
            "--tls-cert",
            str(tmp_path / "c.pem"),
            "--tls-key",
            str(tmp_path / "k.pem"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "contradict" in proc.stderr


# -- TLS to the stores ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """A real etcd serving its clients over TLS only, with a certificate of a local CA."""
    from contract.etcd_server import etcd_argv
    from contract.procs import free_port, stop_process_group

    root = Path(tmp_path_factory.mktemp("tls-etcd"))
    files = ensure_local_certificates(root)
    assert files.ca is not None
    port = free_port()
    argv = [
        a.replace("--listen-client-urls=http://", "--listen-client-urls=https://").replace(
            "--advertise-client-urls=http://", "--advertise-client-urls=https://"
        )
        for a in etcd_argv(root / "data", port, free_port())
    ]
    argv += [f"--cert-file={files.cert}", f"--key-file={files.key}"]
    with open(root / "etcd.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield port, files.ca
    finally:
        stop_process_group(proc.pid, timeout_s=10)
        proc.wait(timeout=10)


def test_an_https_etcd_url_keeps_its_scheme_and_verifies_the_server(
    tls_etcd: tuple[int, Path], tmp_path: Path
) -> None:
    import time

    from contract.etcd import EtcdClient, StoreUnavailable

    port, ca = tls_etcd
    url = f"https://127.0.0.1:{port}/?tlsCAFile={ca}"
    deadline = time.monotonic() + 30
    while True:
        try:
            client = EtcdClient.connect(url)
            break
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    try:
        client.put("/tls-test", {"over": "tls"})
        assert client.get("/tls-test").value == {"over": "tls"}  # type: ignore[union-attr]
    finally:
        client.close()
    with pytest.raises(StoreUnavailable):  # the same server, spoken to in plaintext
        EtcdClient.connect(f"http://127.0.0.1:{port}", timeout_s=2)
    stranger = ensure_local_certificates(tmp_path)  # a CA that did not sign it
    with pytest.raises(StoreUnavailable):
        EtcdClient.connect(f"https://127.0.0.1:{port}/?tlsCAFile={stranger.ca}", timeout_s=2)
    with pytest.raises(ValueError, match="does not exist"):
        EtcdClient.connect(f"https://127.0.0.1:{port}/?tlsCAFile={tmp_path / 'nope.pem'}")


def test_an_elasticsearch_url_takes_its_ca_file_as_mongodb_uris_do(tmp_path: Path) -> None:
    from services.tds.es_store import client_url

    assert client_url("http://127.0.0.1:9200") == ("http://127.0.0.1:9200", {})
    ca = str(tmp_path / "ca.pem")
    assert client_url(f"https://es:9200/?tlsCAFile={ca}") == (
        "https://es:9200/",
        {"ca_certs": ca},
    )
    with pytest.raises(ValueError, match="https"):
        client_url(f"http://es:9200/?tlsCAFile={ca}")
