"""Issue #15 on the running platform, through a real `rhizome up --embedded` (etcd,
MongoDB-wire and Elasticsearch-API servers, the daemon, its guardian, a learner).

etcd authentication: `up` switches it on with credentials in 0600 files of the data
directory; a client without them is refused; a job still runs to COMPLETED; its learner
authenticates as the job's own etcd user, which reaches the job's keys and nothing else.
The daemon's command line holds no store URI. Data-store credentials: the stored record,
GetJob, REST and `rhizome show --json` never hold them; the learner still gets them."""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import os
import secrets
import ssl
import stat
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from rhizome.v1 import job_pb2, tds_pb2

from contract import etcd_keys
from contract.etcd import EtcdAuthError, EtcdClient, EtcdCredentials
from contract.etcd_users import job_etcd_user
from services.client.sdk import Client
from services.embedded.platform import load_state
from services.security.etcd_auth import EtcdAuthFiles
from services.security.tls import JOB_CERT_VALID_ENV
from services.store.job_secrets import JobSecrets
from services.store.mongo import connect
from tests.integration.test_cli import rz
from tests.services.guardian.helpers import wait_for

pytestmark = pytest.mark.integration

# The learner's probe: as the job's etcd user (the file its controller wrote and named in
# RHIZOME_ETCD_CREDENTIALS_FILE), write and read its own job's key, then try another
# job's prefix and the platform's leader keys. One line per outcome, for the test to read.
PROBE = """
import os
from contract.etcd import EtcdAuthError, EtcdClient
job = os.environ["RHIZOME_JOB_ID"]
client = EtcdClient(os.environ["PROBE_ETCD_URL"])
client.put(f"/rhizome/jobs/{job}/probe", {"ok": 1})
print("own-prefix", "read" if client.get(f"/rhizome/jobs/{job}/probe") else "missing")
for name, key in (("other-job", "/rhizome/jobs/someone-else/control"),
                  ("leaders", "/rhizome/leaders/lcm")):
    try:
        client.get(key)
        print(name, "READABLE")
    except EtcdAuthError:
        print(name, "refused")
print("root-credentials-variable", "present" if any("ROOT_CREDENTIALS" in k for k in os.environ) else "absent")
print("credentials-file-mode", oct(os.stat(os.environ["RHIZOME_ETCD_CREDENTIALS_FILE"]).st_mode & 0o777))
"""


# The learner's check of its data-store credentials: the backend's secrets file
# ($RHIZOME_SECRETS) holds the password the test submitted, compared by digest so that
# the password itself is never printed.
# It waits for the test's gate (at most 2 minutes) before it ends: the test reads the
# credentials file while the job runs (the LCM removes it once the job ended).
SECRETS_PROBE = """
import hashlib, os, time
deadline = time.monotonic() + 120
while not os.path.exists(os.environ["GATE"]) and time.monotonic() < deadline:
    time.sleep(0.1)
text = open(os.environ["RHIZOME_SECRETS"]).read()
line = [ln for ln in text.splitlines() if ln.startswith("BUCKET_PASSWORD=")][0]
value = line.split("=", 1)[1]
ok = hashlib.sha256(value.encode()).hexdigest() == os.environ["EXPECTED_SHA256"]
print("secret-delivered", "yes" if ok else "no")
"""


def wait_done(client: Client, job_id: str, timeout_s: float = 120) -> job_pb2.Job:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get_job(job_id)
        if job.status in (job_pb2.COMPLETED, job_pb2.FAILED):
            return job
        time.sleep(0.3)
    return client.get_job(job_id)


def code_zip(name: str, text: str) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(name, text)
    return buf.getvalue()


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    data_dir = Path(tmp_path_factory.mktemp("etcd-auth-embedded"))
    # Job certificates of 10 s (24 h by default), so that a job outlives its first one.
    os.environ[JOB_CERT_VALID_ENV] = "10"
    try:
        rz(data_dir, "up", "--embedded", "--grpc-port", "0", "--rest-port", "0")
    finally:
        os.environ.pop(JOB_CERT_VALID_ENV)
    try:
        yield data_dir
    finally:
        rz(data_dir, "down", check=False)


def etcd_url(data_dir: Path) -> str:
    state = load_state(data_dir)
    assert state is not None
    return state.urls["etcd"]


def test_up_switches_etcd_authentication_on_with_0600_credentials(embedded: Path) -> None:
    files = EtcdAuthFiles.of(embedded)
    for path in (files.root, files.platform):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(files.root.parent.stat().st_mode) == 0o700
    # Without credentials: refused, whatever the key.
    anonymous = EtcdClient(etcd_url(embedded), anonymous=True)
    try:
        with pytest.raises(EtcdAuthError, match="requires authentication"):
            anonymous.get(etcd_keys.leader("lcm"))
    finally:
        anonymous.close()
    # The platform user reads the LCM's leader key (the daemon holds it, so it authenticated).
    platform = EtcdClient.connect(
        etcd_url(embedded), credentials=EtcdCredentials.from_file(files.platform)
    )
    try:
        assert platform.get(etcd_keys.leader("lcm")) is not None
    finally:
        platform.close()


def test_the_daemon_command_line_holds_no_store_uri_or_credential(embedded: Path) -> None:
    state = load_state(embedded)
    assert state is not None
    pid = int(state.processes["api"]["pid"])
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    joined = " ".join(cmdline)
    assert "services.daemon" in joined  # the daemon's, not another process's
    for url in (state.urls["etcd"], state.urls["mongodb"], state.urls["elasticsearch"]):
        assert url not in joined
    for flag in ("--etcd", "--mongodb-uri", "--elasticsearch-url", "credentials"):
        assert flag not in joined
    files = EtcdAuthFiles.of(embedded)
    for path in (files.root, files.platform):
        assert EtcdCredentials.from_file(path).password not in joined
    # The supervisor restarts it the same way: the recipe carries the environment.
    assert state.processes["api"]["env"]["RHIZOME_ETCD"] == state.urls["etcd"]


def test_a_job_completes_and_its_learner_reaches_only_its_own_prefix(embedded: Path) -> None:
    state = load_state(embedded)
    assert state is not None
    code = io.BytesIO()
    with zipfile.ZipFile(code, "w") as zf:
        zf.writestr("probe.py", PROBE)
    manifest = (
        "name: etcd-auth\n"
        "framework: {command: 'python probe.py'}\n"
        f"env: {{PROBE_ETCD_URL: '{etcd_url(embedded)}'}}\n"
    )
    with Client(state.api_address, data_dir=embedded) as client:
        job_id = client.create_job(manifest, code.getvalue()).job_id
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if client.get_job(job_id).status in (job_pb2.COMPLETED, job_pb2.FAILED):
                break
            time.sleep(0.3)
        job = client.get_job(job_id)
        lines = [ln.line for ln in client.logs(tds_pb2.LogsRequest(job_id=job_id, learner=-1))]
    assert job.status == job_pb2.COMPLETED, (job, lines)
    assert "own-prefix read" in lines, lines
    assert "other-job refused" in lines, lines
    assert "leaders refused" in lines, lines
    assert "credentials-file-mode 0o600" in lines, lines
    assert "root-credentials-variable absent" in lines, lines
    # The learner was given the job's own user in its 0600 spec, never the platform's.
    spec_file = embedded / "jobs" / job_id / "learners" / "0" / "spec.json"
    given = EtcdCredentials.parse(json.loads(spec_file.read_text())["etcd_credentials"])
    assert given.user == job_etcd_user(job_id)
    platform = EtcdCredentials.from_file(EtcdAuthFiles.of(embedded).platform)
    root = EtcdCredentials.from_file(EtcdAuthFiles.of(embedded).root)
    for log_file in (embedded / "jobs" / job_id).rglob("*.log"):
        text = log_file.read_text(errors="replace")
        for secret in (given.password, platform.password, root.password):
            assert secret not in text, log_file
    # The job ended: its etcd user is removed (by the LCM, once its guardian exited).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            EtcdClient(etcd_url(embedded), credentials=given).close()
        except EtcdAuthError:
            break
        time.sleep(0.3)
    else:
        pytest.fail(f"job {job_id}'s etcd user still authenticates after the job ended")


def test_data_store_credentials_stay_out_of_the_record_and_every_response(
    embedded: Path, tmp_path: Path
) -> None:
    state = load_state(embedded)
    assert state is not None
    password = "pw-" + secrets.token_hex(12)
    access_key = "ak-" + secrets.token_hex(12)
    manifest = (
        "name: store-secrets\n"
        "framework: {command: 'python probe.py'}\n"
        "data_stores:\n"
        "  - id: bucket\n"
        "    type: s3_datastore\n"
        f"    connection: {{password: '{password}', access_key: '{access_key}'}}\n"
        f"env: {{EXPECTED_SHA256: '{hashlib.sha256(password.encode()).hexdigest()}',"
        f" GATE: '{tmp_path / 'go'}'}}\n"
    )
    with Client(state.api_address, data_dir=embedded) as client:
        job_id = client.create_job(manifest, code_zip("probe.py", SECRETS_PROBE)).job_id
        # Before it runs: the record holds names only; the 0600 file holds the values.
        stored = connect(state.urls["mongodb"])["jobs"].find_one({"_id": job_id})
        assert stored is not None and stored["secrets"] == "file"
        assert stored["manifest"]["data_stores"][0]["connection"] == {
            "password": "***",
            "access_key": "***",
        }
        kept = JobSecrets.in_data_dir(embedded).path(job_id)
        assert stat.S_IMODE(kept.stat().st_mode) == 0o600
        assert stat.S_IMODE(kept.parent.stat().st_mode) == 0o700
        (tmp_path / "go").touch()
        job = wait_done(client, job_id)
        lines = [ln.line for ln in client.logs(tds_pb2.LogsRequest(job_id=job_id, learner=-1))]
        grpc_view = str(client.get_job(job_id))
    assert job.status == job_pb2.COMPLETED, (job, lines)
    assert "secret-delivered yes" in lines, lines  # the learner got them all the same
    ca = ssl.create_default_context(cafile=str(embedded / "tls" / "ca.pem"))
    request = urllib.request.Request(
        f"{state.urls['rest']}/v1/models/{job_id}",
        headers={"Authorization": f"Bearer {(embedded / 'admin.token').read_text().strip()}"},
    )
    with urllib.request.urlopen(request, context=ca, timeout=30) as resp:
        rest_view = resp.read().decode()
    assert job_id in rest_view and "bucket" in rest_view  # the job's own document
    show_view = rz(embedded, "show", job_id, "--json").stdout
    assert job_id in show_view
    stored_view = json.dumps(
        connect(state.urls["mongodb"])["jobs"].find_one({"_id": job_id}), default=str
    )
    for where, text in (
        ("GetJob", grpc_view),
        ("REST", rest_view),
        ("rhizome show --json", show_view),
        ("the MongoDB document", stored_view),
    ):
        for value in (password, access_key):
            assert value not in text, f"{where} holds a data-store credential"
    for log_file in (embedded / "jobs" / job_id).rglob("*.log"):
        assert password not in log_file.read_text(errors="replace"), log_file
    # The job ended for good: its credentials file is removed (by the LCM).
    deadline = time.monotonic() + 30
    while kept.exists() and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not kept.exists(), f"{kept} outlived job {job_id}"


def test_a_job_outlives_its_first_certificate_and_ships_every_line(
    embedded: Path, tmp_path: Path
) -> None:
    """Certificates of 10 s: the guardian renews the job's at half-life into the learner's
    `tds-tls.json`, the collector follows, and lines printed after the first certificate
    expired still reach the TDS over mutual TLS."""
    state = load_state(embedded)
    assert state is not None
    # A tick every 0.5 s until the test opens the gate, once the first certificate
    # expired; then 4 more (a fixed 16 s of ticks before, at most 2 minutes now).
    gate = tmp_path / "go"
    probe = (
        "import os, time\ni = 0\n"
        f"while not os.path.exists({str(gate)!r}) and i < 240:\n"
        "    print('tick', i, flush=True)\n    i += 1\n    time.sleep(0.5)\n"
        "for _ in range(4):\n"
        "    print('tick', i, flush=True)\n    i += 1\n    time.sleep(0.5)\n"
    )
    manifest = "name: renew-cert\nframework: {command: 'python ticks.py'}\n"
    with Client(state.api_address, data_dir=embedded) as client:
        job_id = client.create_job(manifest, code_zip("ticks.py", probe)).job_id
        learner = embedded / "jobs" / job_id / "learners" / "0"

        def expired() -> bool:
            try:  # not written yet, or being written
                pem = json.loads((learner / "spec.json").read_text())["tds_tls"]["cert"]
            except (OSError, ValueError, KeyError):
                return False
            after = x509.load_pem_x509_certificate(pem.encode()).not_valid_after_utc
            return after < datetime.datetime.now(datetime.UTC)

        wait_for("the job's first certificate to expire", expired, 60)
        gate.touch()
        job = wait_done(client, job_id)
        assert job.status == job_pb2.COMPLETED, job
        # every tick the learner printed (its own file) must reach the TDS
        ticks = (learner / "stdout.log").read_text().count("tick ")
        assert ticks > 4, "no tick before the gate"
        deadline = time.monotonic() + 30
        lines: list[str] = []
        while time.monotonic() < deadline:
            req = tds_pb2.LogsRequest(job_id=job_id, learner=-1)
            lines = [ln.line for ln in client.logs(req)]
            if f"tick {ticks - 1}" in lines:
                break
            time.sleep(0.5)
    assert [ln for ln in lines if ln.startswith("tick ")] == [f"tick {i}" for i in range(ticks)]
    first = json.loads((learner / "spec.json").read_text())["tds_tls"]["cert"]
    renewed = json.loads((learner / "tds-tls.json").read_text())["cert"]
    assert renewed != first
    assert stat.S_IMODE((learner / "tds-tls.json").stat().st_mode) == 0o600
    assert (
        "renewed its learners' TDS certificate"
        in (embedded / "jobs" / job_id / "guardian.log").read_text()
    )
