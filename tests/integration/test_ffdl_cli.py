"""FfDL parity through the real embedded platform (`rhizome up --embedded`: etcd, the
MongoDB-wire and Elasticsearch-API servers, the daemon with its scheduler, LCM and local
backend) and the `rhizome` CLI: a job that writes results, `rhizome download` of its
trained model and definition, and `rhizome events` whose webhook hears the job complete
(a status change made by the job's guardian, not by the API)."""

from __future__ import annotations

import hashlib
import hmac
import json
import queue
import threading
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_cli import embedded_up, rz

pytestmark = pytest.mark.integration

# Waits until the test registered its webhook and opened the gate (a fixed 5 s before:
# longer than needed on an idle machine, maybe too short on a loaded one; at most 2 min).
TRAIN = """\
import os, pathlib, time
for _ in range(1200):
    if os.path.exists({gate!r}):
        break
    time.sleep(0.1)
out = pathlib.Path(os.environ["RHIZOME_RESULT_DIR"])
(out / "model.txt").write_text("trained weights")
print("done")
"""


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with embedded_up(Path(tmp_path_factory.mktemp("ffdl-embedded"))) as data_dir:
        yield data_dir


@pytest.fixture
def hook() -> Iterator[tuple[str, queue.Queue[tuple[dict[str, str], bytes]]]]:
    got: queue.Queue[tuple[dict[str, str], bytes]] = queue.Queue()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            got.put((dict(self.headers), body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/done", got
    finally:
        server.shutdown()
        server.server_close()


def test_a_completed_jobs_model_downloads_and_its_webhook_hears_it_complete(
    embedded: Path, tmp_path: Path, hook: Any
) -> None:
    url, got = hook
    code = tmp_path / "code"
    code.mkdir()
    gate = tmp_path / "go"
    train = TRAIN.format(gate=str(gate))
    (code / "train.py").write_text(train)
    manifest = code / "manifest.yml"
    manifest.write_text("name: ffdl parity job\nframework:\n  command: python train.py\n")
    submitted = json.loads(rz(embedded, "train", str(manifest), "--json").stdout)
    job_id = submitted["job_id"]
    assert submitted["job"]["display_name"] == "ffdl parity job"
    assert submitted["job"]["name"] == "ffdl-parity-job"

    added = json.loads(rz(embedded, "events", "add", job_id, "completed", url, "--json").stdout)
    secret = added["secret"]
    listed = rz(embedded, "events", "list", job_id, "--json")
    assert [e["url"] for e in json.loads(listed.stdout)] == [url]
    assert secret not in listed.stdout
    gate.touch()

    try:
        headers, body = got.get(timeout=180)
    except queue.Empty:
        shown = rz(embedded, "show", job_id, "--json").stdout
        raise AssertionError(f"no `completed` event within 180s; the job: {shown}") from None
    event = json.loads(body)
    assert (event["job_id"], event["status"]) == (job_id, "COMPLETED")
    signed = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(headers["X-Rhizome-Signature"], signed)

    model = tmp_path / "model.zip"
    done = json.loads(rz(embedded, "download", job_id, "-o", str(model), "--json").stdout)
    assert done["bytes"] == model.stat().st_size
    assert zipfile.ZipFile(model).read("0/model.txt") == b"trained weights"
    again = rz(embedded, "download", job_id, "-o", str(model), check=False)
    assert again.returncode == 1 and "exists; pass --force" in again.stderr
    definition = tmp_path / "definition.zip"
    rz(embedded, "download", job_id, "--definition", "-o", str(definition))
    assert zipfile.ZipFile(definition).read("train.py").decode() == train

    removed = rz(embedded, "events", "rm", job_id, "completed", added["endpoint"]["endpoint_id"])
    assert "deleted" in removed.stdout
    assert json.loads(rz(embedded, "events", "list", job_id, "--json").stdout) == []


def test_event_and_download_errors_are_one_line(embedded: Path, tmp_path: Path) -> None:
    bad = rz(embedded, "events", "add", "no-such-job", "status", "http://127.0.0.1:1/", check=False)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    manifest = tmp_path / "manifest.yml"
    manifest.write_text("name: quick\nframework:\n  command: 'true'\n")
    job_id = json.loads(rz(embedded, "train", str(manifest), "--json").stdout)["job_id"]
    scheme = rz(embedded, "events", "add", job_id, "status", "file:///etc/passwd", check=False)
    assert scheme.returncode == 1 and "use http:// or https://" in scheme.stderr
    assert len(scheme.stderr.strip().splitlines()) == 1
    kind = rz(embedded, "events", "add", job_id, "exploded", "http://127.0.0.1:1/", check=False)
    assert kind.returncode == 1 and "choose one of: status" in kind.stderr
