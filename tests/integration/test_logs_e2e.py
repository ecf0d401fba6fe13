"""Through the whole embedded platform: `rhizome logs --follow` shows a running job's
lines and returns when the job ends; `rhizome metrics` shows what the regex source
extracted; `rhizome show` of a failed job prints its last lines from the log store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.embedded.process import ManagedServer
from tests.daemons import start_daemon
from tests.integration.test_cli import rz

pytestmark = pytest.mark.integration

SCRIPT = """import time
for step in range(1, 6):
    print(f"step {step} loss={1.0 / step:.4f}", flush=True)
    time.sleep(0.3)
print("training done", flush=True)
"""

MANIFEST = """name: logs-e2e
memory: 256MiB
framework:
  command: python train.py
evaluation_metrics:
  type: regex_extractor
  in: stdout
  regex: 'step (?P<step>\\d+) loss=(?P<loss>[0-9.]+)'
"""


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    data_dir = Path(tmp_path_factory.mktemp("logs-e2e"))
    rz(data_dir, "up", "--embedded", "--grpc-port", "0", "--rest-port", "0")
    try:
        yield data_dir
    finally:
        rz(data_dir, "down", check=False)


def test_follow_shows_every_line_and_returns_when_the_job_ends(
    platform: Path, tmp_path: Path
) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "manifest.yml").write_text(MANIFEST)
    job_id = json.loads(rz(platform, "train", str(tmp_path / "manifest.yml"), "--json").stdout)[
        "job_id"
    ]
    followed = rz(platform, "logs", job_id, "--follow").stdout.splitlines()
    assert followed == [f"[0/stdout] step {s} loss={1.0 / s:.4f}" for s in range(1, 6)] + [
        "[0/stdout] training done"
    ]
    assert json.loads(rz(platform, "show", job_id, "--json").stdout)["status"] == "COMPLETED"
    samples = json.loads(rz(platform, "metrics", job_id, "--json").stdout)
    assert sorted((int(s["step"]), round(s["value"], 4)) for s in samples) == [
        (s, round(1.0 / s, 4)) for s in range(1, 6)
    ]
    tail = rz(platform, "logs", job_id, "--tail", "2").stdout.splitlines()
    assert tail == ["[0/stdout] step 5 loss=0.2000", "[0/stdout] training done"]


def test_show_of_a_failed_job_prints_its_last_lines(platform: Path, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(
        "print('about to fail', flush=True)\nraise SystemExit('bad input: no data')\n"
    )
    (tmp_path / "manifest.yml").write_text(
        "name: fails\nmemory: 256MiB\nmax_learner_restarts: 0\nframework:\n  command: python train.py\n"
    )
    job_id = json.loads(rz(platform, "train", str(tmp_path / "manifest.yml"), "--json").stdout)[
        "job_id"
    ]
    assert rz(platform, "logs", job_id, "--follow").returncode == 0
    shown = rz(platform, "show", job_id).stdout
    assert "FAILED" in shown
    assert "about to fail" in shown and "bad input: no data" in shown


def test_deleting_a_job_deletes_its_logs_after_the_retention(
    mongo_server: ManagedServer,
    es_server: ManagedServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import time

    from rhizome.v1 import tds_pb2

    from tests.integration.conftest import token_client

    monkeypatch.setenv("RHIZOME_LOG_RETENTION_S", "0")
    daemon = start_daemon(tmp_path, mongo_server, es=es_server, services=("api", "tds"))
    try:
        with token_client(daemon, "forgetful") as rz:
            job_id = rz.create_job("name: forget\nframework: {command: 'true'}\n").job_id
            import grpc
            from rhizome.v1 import tds_pb2_grpc

            from contract.credentials import with_bearer

            # The TDS is on the internal port, for holders of the service credential.
            channel = grpc.insecure_channel(daemon.config.internal_address)
            tds = tds_pb2_grpc.TrainingDataStub(
                with_bearer(channel, daemon.credentials.service_token())
            )
            line = tds_pb2.LogLine(job_id=job_id, learner=0, stream="stdout", seq=0, line="secret")
            tds.AddLogLines(tds_pb2.AddLogLinesRequest(lines=[line]), timeout=10)
            req = tds_pb2.LogsRequest(job_id=job_id, learner=-1)
            assert [ln.line for ln in rz.logs(req)] == ["secret"]
            rz.delete_job(job_id)
            deadline = time.monotonic() + 20
            while list(rz.logs(req)) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert list(rz.logs(req)) == []
            channel.close()
    finally:
        daemon.stop()
