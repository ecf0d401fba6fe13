"""Helpers shared by the TDS and collector tests: an in-process TDS, a TDS process."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from rhizome.v1 import tds_pb2, tds_pb2_grpc

from contract.procs import stop_process_group
from services.tds.api import TrainingDataStore
from services.tds.server import serve
from services.tds.servicer import TrainingDataServicer
from tests.daemons import running_daemon

REPO = Path(__file__).resolve().parents[3]


@contextlib.contextmanager
def tds_in_process(
    store: TrainingDataStore, job_finished: Callable[[str], bool] | None = None, **kw: Any
) -> Iterator[tuple[str, TrainingDataServicer]]:
    server, servicer, port = serve(
        "127.0.0.1:0", store, job_finished=job_finished, max_workers=16, **kw
    )
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        servicer.close()
        server.stop(grace=None)


def stub(address: str) -> tuple[grpc.Channel, tds_pb2_grpc.TrainingDataStub]:
    channel = grpc.insecure_channel(address)
    return channel, tds_pb2_grpc.TrainingDataStub(channel)


def log_line(
    job: str, learner: int, stream: str, seq: int, text: str, t_us: int
) -> tds_pb2.LogLine:
    ln = tds_pb2.LogLine(job_id=job, learner=learner, stream=stream, seq=seq, line=text)
    ln.time.seconds, ln.time.nanos = t_us // 1_000_000, (t_us % 1_000_000) * 1000
    return ln


class TDSProcess:
    """`python -m services.tds` on a fixed port, so that it can be killed and restarted."""

    def __init__(self, es_url: str, port: int, log_path: Path) -> None:
        self.es_url, self.port, self.log_path = es_url, port, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> None:
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.tds",
                "--address",
                self.address,
                "--es-url",
                self.es_url,
            ],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"TDS exited early; see {self.log_path}")
            if b"tds listening on" in self.log_path.read_bytes():
                return
            time.sleep(0.05)
        raise RuntimeError(f"TDS did not start; see {self.log_path}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)
        # Forget the old "listening" line so that start() waits for the new one.
        self.log_path.write_bytes(b"")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_process_group(self.proc.pid)
            self.proc.wait(timeout=10)


@contextlib.contextmanager
def mutual_tls_tds(
    mongo_url: str, es_url: str, data_dir: Path, database: str, job_id: str
) -> Iterator[tuple[Any, Any, str]]:
    """A daemon hosting the TDS alone, its internal port on mutual TLS (the platform's own
    CA under `data_dir/ca`), in a database of its own: yields the daemon, the CA that
    issues job certificates, and `job_id`'s TDS token."""
    from services.security.internal import SharedSecretCredentials
    from services.security.tls import InternalTls

    secret = data_dir / "internal.secret"
    with running_daemon(
        data_dir,
        mongo_url,
        database=database,
        elasticsearch_url=es_url,
        services=("tds",),
        internal_secret_file=str(secret),
        internal_tls_dir=str(data_dir / "ca"),
    ) as running:
        token = SharedSecretCredentials.from_file(secret, create=False).job_token(job_id)
        yield running, InternalTls(data_dir / "ca"), token
