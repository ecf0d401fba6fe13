"""A throwaway platform for the lifecycle benchmarks: real etcd, a real MongoDB-wire
server and the daemon (api + lcm) in a temporary directory, on free ports. etcd runs with
authentication, as under `rhizome up`: the daemon gets its credential files (and the
store URIs) in its environment, and this process's own etcd clients authenticate as the
platform user (`RHIZOME_ETCD_CREDENTIALS_FILE`, set on entry)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "gen")]

from contract.env import ETCD_CREDENTIALS_FILE  # noqa: E402
from contract.procs import free_port  # noqa: E402
from services.client.sdk import Client, zip_directory  # noqa: E402
from services.embedded.platform import DaemonServer  # noqa: E402
from services.embedded.servers import EtcdServer, MongoServer  # noqa: E402
from services.security.etcd_auth import EtcdAuthFiles, ensure_etcd_auth  # noqa: E402
from services.store.jobs import JobRecord, JobsRepository  # noqa: E402
from services.store.mongo import connect  # noqa: E402


class BenchPlatform:
    """`services`: what the daemon hosts; `daemon_args`: more rhizomed flags (a backend, a
    cluster config). The temporary directory is removed on exit unless
    RHIZOME_BENCH_KEEP=1 (to read the logs of a failed run)."""

    def __init__(self, services: str = "api,lcm", daemon_args: Sequence[str] = ()) -> None:
        self.services = services
        self.daemon_args = list(daemon_args)
        self.data_dir = Path(tempfile.mkdtemp(prefix="rhizome-bench-"))
        self.etcd = EtcdServer(self.data_dir / "deps" / "etcd")
        self.mongo = MongoServer(self.data_dir / "deps" / "mongo")
        self.port, self.rest = free_port(), free_port()
        self.daemon: DaemonServer | None = None
        self.etcd_auth: EtcdAuthFiles | None = None

    def __enter__(self) -> BenchPlatform:
        self.etcd.start()
        self.etcd_auth = ensure_etcd_auth(self.data_dir, self.etcd.url)
        os.environ.update(self.etcd_auth.client_environ())
        self.mongo.start()
        self.start_daemon()
        return self

    def daemon_argv_args(self) -> list[str]:
        """The rhizomed flags of this platform's daemon (a standby takes the same)."""
        return [
            f"--services={self.services}",
            f"--admin-token-file={self.data_dir / 'admin.token'}",
            *self.daemon_args,
        ]

    def daemon_environ(self) -> dict[str, str]:
        """The stores' URIs and etcd credential files, in the daemon's environment (not on
        its command line), as `rhizome up` gives them; a standby takes the same."""
        assert self.etcd_auth is not None
        return {
            "RHIZOME_MONGODB_URI": self.mongo.url,
            "RHIZOME_ETCD": self.etcd.url,
            **self.etcd_auth.daemon_environ(),
        }

    def start_daemon(self) -> None:
        self.daemon = DaemonServer(
            self.data_dir,
            self.port,
            self.rest,
            self.daemon_argv_args(),
            environ=self.daemon_environ(),
        )
        self.daemon.start_timeout_s = 60
        self.daemon.start()

    def kill_daemon(self) -> None:
        assert self.daemon is not None and self.daemon.pid is not None
        os.kill(self.daemon.pid, signal.SIGKILL)
        assert self.daemon.proc is not None
        self.daemon.proc.wait(timeout=10)

    @property
    def api(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        """The admin token the daemon wrote on its first start."""
        return (self.data_dir / "admin.token").read_text().strip()

    def __exit__(self, *exc: object) -> None:
        if self.daemon is not None:
            self.daemon.stop(timeout_s=30)
        self.mongo.stop()
        self.etcd.stop()
        os.environ.pop(ETCD_CREDENTIALS_FILE, None)
        if os.environ.get("RHIZOME_BENCH_KEEP") != "1":
            shutil.rmtree(self.data_dir, ignore_errors=True)
        else:
            print(f"kept {self.data_dir}", file=sys.stderr)


RHIZOME_CLI = [sys.executable, "-m", "services.client.cli"]


def rz(data_dir: Path, *args: str, timeout_s: float = 300, tree: Path | None = None) -> str:
    """`rhizome --data-dir DATA_DIR ARGS` as a user types it (the CLI finds the embedded
    platform's admin token by itself); its stdout, or the run ends naming the command.
    `tree`: another checkout's `rhizome`, its code first on the path of every process the
    platform starts (daemon, guardian host, controllers inherit the environment)."""
    env = {**os.environ, "COLUMNS": "200"}
    if tree is not None:
        env["PYTHONPATH"] = f"{tree}:{tree / 'gen'}"
    env.pop("RHIZOME_TOKEN", None)
    proc = subprocess.run(
        [*RHIZOME_CLI, "--data-dir", str(data_dir), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT if tree is None else tree,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        where = "" if tree is None else f" ({tree})"
        sys.exit(f"rhizome {' '.join(args)}{where} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout


class EmbeddedUp:
    """`rhizome up --embedded` in a temporary data directory (every service: api,
    scheduler, lcm, tds, the local backend; what a user runs), `rhizome down` on exit.
    The directory is removed unless RHIZOME_BENCH_KEEP=1."""

    def __init__(self) -> None:
        self.data_dir = Path(tempfile.mkdtemp(prefix="rhizome-bench-up-"))

    def __enter__(self) -> EmbeddedUp:
        rz(self.data_dir, "up", "--embedded", "--grpc-port", "0", "--rest-port", "0")
        return self

    def __call__(self, *args: str, timeout_s: float = 300) -> str:
        return rz(self.data_dir, *args, timeout_s=timeout_s)

    def __exit__(self, *exc: object) -> None:
        rz(self.data_dir, "down")
        if os.environ.get("RHIZOME_BENCH_KEEP") != "1":
            shutil.rmtree(self.data_dir, ignore_errors=True)
        else:
            print(f"kept {self.data_dir}", file=sys.stderr)


def start_injector(
    etcd_url: str,
    job_id: str,
    trace: str,
    *,
    time_scale: float,
    notice: float,
    seed: int,
    extra: Sequence[str] = (),
) -> subprocess.Popen[str]:
    """The fault injector (`python -m services.injector`, what `rhizome inject --job`
    runs) replaying `trace` against one job's learners; it prints its injections as JSON
    on stdout at the end (`communicate()`). `extra`: more injector flags."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.injector",
            "--job",
            job_id,
            "--etcd",
            etcd_url,
            "--trace",
            trace,
            "--time-scale",
            str(time_scale),
            "--notice",
            str(notice),
            "--seed",
            str(seed),
            *extra,
            "--json",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


def until_or_exit(probe: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll `probe` until it is true; past `timeout_s` the run ends naming `what`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if probe():
            return
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {what}")


def run_under_trace(
    platform: BenchPlatform,
    manifest: str,
    code: Path,
    progress: Path,
    *,
    trace: str,
    time_scale: float,
    notice: float,
    seed: int,
    injector_args: Sequence[str],
    start_timeout_s: float,
    end_timeout_s: float,
) -> tuple[JobRecord, str]:
    """Submit the job, wait for its first line in `progress` (the learner writes it), then
    replay `trace` against the job with the fault injector (`start_injector`, more flags
    in `injector_args`) until the job ends: its final record and the injector's stdout."""
    client = Client(platform.api, token=platform.token, timeout_s=10)
    repo = JobsRepository(connect(platform.mongo.url))
    job_id = client.create_job(manifest, code_zip=zip_directory(code)).job_id
    print(f"job {job_id} submitted; waiting for its first progress line", file=sys.stderr)
    until_or_exit(
        lambda: progress.exists() and progress.read_text().strip(),
        start_timeout_s,
        "the job's first progress line",
    )
    injector = start_injector(
        platform.etcd.url,
        job_id,
        trace,
        time_scale=time_scale,
        notice=notice,
        seed=seed,
        extra=injector_args,
    )
    print("the injector replays the trace; the job trains", file=sys.stderr)
    until_or_exit(
        lambda: repo.get(job_id).status in ("COMPLETED", "FAILED"), end_timeout_s, "the job's end"
    )
    record = repo.get(job_id)
    out, _ = injector.communicate(timeout=300)
    client.close()
    return record, out
