"""TLS for the public ports: a local certificate authority and server certificate for the
embedded platform, or certificates of your own.

`rhizome up` calls `ensure_local_certificates(data_dir)`: on first start it generates
`<data dir>/tls/ca.pem` (a CA that signs nothing but this platform's server certificate;
its key `ca.key` is 0600) and `server.pem`/`server.key` (0600) valid for localhost,
127.0.0.1, ::1 and this host's name. Later starts reuse them, and replace the server
certificate when it is within 30 days of expiring or does not match the CA. The CLI and
SDK trust `ca.pem` when they talk to that platform, as they pick up `admin.token`.

The same CA issues the certificates for mutual TLS on the internal port
(docs/security.md): `ensure_client_certificate` gives a daemon a client certificate of
its own, `internal_server_credentials` a gRPC server that requires one signed by the CA,
`internal_channel_credentials` the matching client side; `InternalTls` puts them
together for the daemon, and issues each job's learners theirs.

Keys are ECDSA P-256: the smallest handshake cost of the common choices, which the
submit benchmark (benchmarks/security_overhead.py) pays on every new connection.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.security.api import TlsError

TLS_DIR = "tls"
CA_FILE = "ca.pem"
CA_KEY_FILE = "ca.key"
CERT_FILE = "server.pem"
KEY_FILE = "server.key"
CA_DAYS = 3650
SERVER_DAYS = 397  # what browsers accept for a server certificate
RENEW_BEFORE = datetime.timedelta(days=30)


@dataclass(frozen=True)
class TlsFiles:
    """A server certificate (chain), its key, and the CA clients should trust."""

    cert: Path
    key: Path
    ca: Path | None = None

    def load(self) -> tuple[bytes, bytes]:
        """The certificate and key bytes, checked to belong together."""
        cert_pem = _read(self.cert, "certificate (--tls-cert)")
        key_pem = _read(self.key, "private key (--tls-key)")
        try:
            cert = x509.load_pem_x509_certificates(cert_pem)[0]
        except ValueError as exc:
            raise TlsError(f"{self.cert} is not a PEM certificate ({exc})") from None
        try:
            key = serialization.load_pem_private_key(key_pem, password=None)
        except (ValueError, TypeError) as exc:
            raise TlsError(
                f"{self.key} is not an unencrypted PEM private key ({exc}); decrypt it with "
                "`openssl pkey -in KEY -out KEY.plain`"
            ) from None
        if cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ) != key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ):
            raise TlsError(f"the key {self.key} does not belong to the certificate {self.cert}")
        return cert_pem, key_pem

    def ca_bytes(self) -> bytes | None:
        return _read(self.ca, "CA certificate (--tls-ca)") if self.ca else None


def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TlsError(f"cannot read the TLS {what} {path}: {exc.strerror}") from None


def _write_private(path: Path, data: bytes) -> None:
    from services.api.auth import write_secret_file

    write_secret_file(path, data.decode().rstrip("\n"))


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def server_names() -> tuple[list[str], list[str]]:
    """DNS names and IP addresses the local server certificate is valid for."""
    names = ["localhost"]
    host = socket.gethostname()
    if host and host not in names:
        names.append(host)
    return names, ["127.0.0.1", "::1"]


def _make_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [x509.NameAttribute(NameOID.COMMON_NAME, f"Rhizome local CA ({socket.gethostname()})")]
    )
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_private(directory / CA_KEY_FILE, _key_pem(key))
    (directory / CA_FILE).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def _make_server(directory: Path, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    dns, ips = server_names()
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rhizomed")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(min(now + datetime.timedelta(days=SERVER_DAYS), ca.not_valid_after_utc))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(n) for n in dns]
                + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_private(directory / KEY_FILE, _key_pem(key))
    (directory / CERT_FILE).write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    try:
        cert = x509.load_pem_x509_certificate((directory / CA_FILE).read_bytes())
        key = serialization.load_pem_private_key(
            (directory / CA_KEY_FILE).read_bytes(), password=None
        )
    except (OSError, ValueError, TypeError):
        return None
    if (
        not isinstance(key, ec.EllipticCurvePrivateKey)
        or cert.not_valid_after_utc - _now() < RENEW_BEFORE
    ):
        return None
    return cert, key


def _server_current(directory: Path, ca: x509.Certificate) -> bool:
    try:
        cert = x509.load_pem_x509_certificate((directory / CERT_FILE).read_bytes())
        TlsFiles(directory / CERT_FILE, directory / KEY_FILE).load()
        cert.verify_directly_issued_by(ca)
    except Exception:  # unreadable, a key of another certificate, signed by another CA
        return False
    return cert.not_valid_after_utc - _now() >= RENEW_BEFORE


def ensure_local_certificates(data_dir: Path) -> TlsFiles:
    """The embedded platform's CA and server certificate under `<data_dir>/tls`, generated
    when missing, expiring within 30 days or not matching each other."""
    return ensure_certificates_in(Path(data_dir) / TLS_DIR)


def ensure_certificates_in(directory: Path) -> TlsFiles:
    """`ensure_local_certificates` for a CA directory named directly (the internal port's
    `--internal-tls-dir`, which daemons that are each other's peers share)."""
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    loaded = _load_ca(directory)
    if loaded is None:
        loaded = _make_ca(directory)
        _make_server(directory, *loaded)
    elif not _server_current(directory, loaded[0]):
        _make_server(directory, *loaded)
    return TlsFiles(directory / CERT_FILE, directory / KEY_FILE, directory / CA_FILE)


# -- mutual TLS on the internal port ------------------------------------------------------
CLIENT_DAYS = 397
# A job's certificate: short, since a learner runs the user's code and could leak it; the
# guardian re-issues it at half-life (`renewal_due`) into each learner's `tds-tls.json`,
# which the log collector re-reads (docs/security.md).
JOB_CERT_VALID = datetime.timedelta(hours=24)
CLOCK_SKEW = datetime.timedelta(minutes=5)  # a client certificate is valid from this long ago
JOB_CERT_VALID_ENV = "RHIZOME_JOB_CERT_VALID_S"  # another validity, in seconds (tests)


def job_cert_valid() -> datetime.timedelta:
    """How long a job certificate is valid: `$RHIZOME_JOB_CERT_VALID_S`, else 24 h."""
    raw = os.environ.get(JOB_CERT_VALID_ENV, "")
    try:
        seconds = float(raw) if raw else JOB_CERT_VALID.total_seconds()
    except ValueError:
        raise TlsError(f"${JOB_CERT_VALID_ENV} is {raw!r}; give seconds, e.g. 86400") from None
    if seconds < 10:
        raise TlsError(f"${JOB_CERT_VALID_ENV} is {raw!r}; give at least 10 seconds")
    return datetime.timedelta(seconds=seconds)


def _client_name_ok(name: str) -> bool:
    return bool(name) and len(name) <= 64 and all(c.isalnum() or c in "-_." for c in name)


def ensure_client_certificate(data_dir: Path, name: str = "daemon") -> TlsFiles:
    """A client certificate for `name` (a daemon, or `job-...` for a job's learners) signed
    by the platform's CA in `<data_dir>/tls`: `<name>.client.pem` / `<name>.client.key`
    (0600), made when missing, expiring within 30 days or signed by another CA. The CA
    must exist (`ensure_local_certificates`)."""
    return ensure_client_certificate_in(Path(data_dir) / TLS_DIR, name)


def _ca_for_clients(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    loaded = _load_ca(directory)
    if loaded is None:
        raise TlsError(
            f"no usable CA in {directory} to issue a client certificate; start the platform "
            "with TLS (`rhizome up` makes one)"
        )
    return loaded


def ensure_client_certificate_in(directory: Path, name: str = "daemon") -> TlsFiles:
    """`ensure_client_certificate` for a CA directory named directly."""
    if not _client_name_ok(name):
        raise TlsError(f"client certificate name {name!r}: letters, digits, - _ . only")
    directory = Path(directory)
    ca, ca_key = _ca_for_clients(directory)
    files = TlsFiles(
        directory / f"{name}.client.pem", directory / f"{name}.client.key", directory / CA_FILE
    )
    try:
        cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
        files.load()
        cert.verify_directly_issued_by(ca)
        if cert.not_valid_after_utc - _now() >= RENEW_BEFORE:
            return files
    except Exception:  # missing, unreadable, another CA's: make a new one
        pass
    cert_pem, key_pem = _issue_client(ca, ca_key, name, datetime.timedelta(days=CLIENT_DAYS))
    _write_private(files.key, key_pem)
    files.cert.write_bytes(cert_pem)
    return files


def _issue_client(
    ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, name: str, valid: datetime.timedelta
) -> tuple[bytes, bytes]:
    """A `clientAuth` certificate for `name` signed by `ca`, and its key (PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(min(now + valid, ca.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def internal_server_credentials(server: TlsFiles) -> grpc.ServerCredentials:
    """TLS with `server`'s certificate that requires every client to present a
    certificate signed by `server.ca`: a client without one, or with another CA's, is
    refused in the handshake, before any call or credential is read."""
    if server.ca is None:
        raise TlsError("mutual TLS needs the CA that signs the clients' certificates")
    cert, key = server.load()
    ca = server.ca_bytes()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=True
    )


def internal_channel_credentials(client: TlsFiles) -> grpc.ChannelCredentials:
    """The client side: trust `client.ca` for the server, present `client`'s certificate."""
    cert, key = client.load()
    return grpc.ssl_channel_credentials(
        root_certificates=client.ca_bytes(), private_key=key, certificate_chain=cert
    )


@dataclass(frozen=True)
class InternalTls:
    """Mutual TLS on the internal port, from one CA directory (`rhizome up`'s
    `<data dir>/tls`, or `--internal-tls-dir`): the daemon serves with the CA's server
    certificate and admits only clients presenting a certificate of that CA; its own
    channels present `<name>.client.pem`; each job's learners get a certificate of their
    own, in memory, carried in their 0600 learner spec (`job_credentials`)."""

    directory: Path
    name: str = "daemon"

    @classmethod
    def open(cls, directory: Path, name: str = "daemon") -> InternalTls:
        """The CA directory, its server and client certificates made when missing or
        due (TlsError naming the directory when it cannot be)."""
        try:
            ensure_certificates_in(Path(directory))
            ensure_client_certificate_in(Path(directory), name)
        except OSError as exc:
            raise TlsError(
                f"cannot prepare the internal port's certificates in {directory}: {exc}"
            ) from None
        return cls(Path(directory), name)

    @property
    def server_files(self) -> TlsFiles:
        return TlsFiles(
            self.directory / CERT_FILE, self.directory / KEY_FILE, self.directory / CA_FILE
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        return internal_server_credentials(self.server_files)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return internal_channel_credentials(ensure_client_certificate_in(self.directory, self.name))

    def job_credentials(
        self, job_id: str, valid: datetime.timedelta | None = None
    ) -> dict[str, str]:
        """`{ca, cert, key}` (PEM text) for `job_id`'s learners: a certificate named
        `job-<id>`, valid `valid` (24 h), never written to the CA directory (the learner
        spec carries it; the guardian renews it, `renewal_due`). The job token, required
        on top, is what confines it to its own job."""
        ca, ca_key = _ca_for_clients(self.directory)
        name = f"job-{job_id}"[:64]
        if not _client_name_ok(name):
            raise TlsError(f"job id {job_id!r} cannot name a client certificate")
        cert, key = _issue_client(ca, ca_key, name, valid or job_cert_valid())
        return {
            "ca": (self.directory / CA_FILE).read_text(),
            "cert": cert.decode(),
            "key": key.decode(),
        }


def renewal_due(tls: Mapping[str, str], now: datetime.datetime | None = None) -> bool:
    """Whether the job certificate in `tls` (`{ca, cert, key}`) is past half its validity
    from issue (its start is back-dated by CLOCK_SKEW), or unreadable: time for the
    guardian to issue the next one."""
    try:
        cert = x509.load_pem_x509_certificate(tls["cert"].encode())
    except (KeyError, ValueError):
        return True
    end = cert.not_valid_after_utc
    lifetime = end - cert.not_valid_before_utc - CLOCK_SKEW
    return (now or _now()) >= end - lifetime / 2
