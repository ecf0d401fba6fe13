"""`make demo`: the whole platform on this machine, one real training job, end to end.

1. starts the embedded platform (etcd, a MongoDB-wire server, an Elasticsearch-API
   server and the daemon) in a temporary data directory on free ports;
2. submits examples/mnist (a small CNN on scikit-learn's bundled digits);
3. shows every status change and the learner's output as it trains (read from the
   learner's log files in its job directory, so it works with or without log streaming;
   on the docker backend, where the output is the container's, from the TDS);
4. halts the job (30 epochs here) after its third epoch and resumes it: the learner
   starts again from the checkpoint it saved through the SDK (examples/mnist checkpoints
   every epoch), so the resumed run continues where it stopped instead of starting over;
5. shows the job COMPLETED with its final accuracy, then stops the platform.

`--backend docker` (`make demo-docker`) runs the learner in a container instead: the
platform uses DOCKER_HOST's engine or starts its own dockerd under the data directory,
and builds the learner image offline if the engine lacks it.

Exits non-zero if anything fails, after stopping the platform.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "gen")]

from services.client.sdk import Client, ClientError, zip_directory  # noqa: E402
from services.embedded.platform import load_state  # noqa: E402

EXAMPLE = ROOT / "examples" / "mnist"
TIMEOUT_S = 600
HALT_AFTER_EPOCH = 3
DEMO_EPOCHS = 30
TERMINAL = {"COMPLETED", "FAILED", "DELETED", "HALTED"}


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def rhizome(data_dir: Path, *args: str) -> int:
    cmd = [sys.executable, "-m", "services.client.cli", "--data-dir", str(data_dir), *args]
    return subprocess.call(cmd, cwd=ROOT)


class LogTail:
    """Prints new lines of a learner's stdout/stderr files as they grow."""

    def __init__(self, learner_dir: Path) -> None:
        self.files = [learner_dir / "stdout.log", learner_dir / "stderr.log"]
        self.offsets = {f: 0 for f in self.files}
        self.lines: list[str] = []

    def poll(self) -> None:
        for path in self.files:
            try:
                with open(path, "rb") as fh:
                    fh.seek(self.offsets[path])
                    data = fh.read()
            except OSError:
                continue
            if not data and path.stat().st_size < self.offsets[path]:
                self.offsets[path] = 0  # a restarted learner began the file again
                continue
            complete = data.rsplit(b"\n", 1)[0] + b"\n" if b"\n" in data else b""
            self.offsets[path] += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                self.lines.append(line)
                stream = "" if path.name == "stdout.log" else " (stderr)"
                print(f"    learner 0{stream} | {line}", flush=True)


class TdsTail:
    """Prints a learner's new lines from the TDS: on the docker backend the learner writes
    to its container's streams, which the job's log collector ships there (no files)."""

    def __init__(self, client: Client, job_id: str) -> None:
        self.client, self.job_id = client, job_id
        self.seen = 0
        self.lines: list[str] = []

    def poll(self) -> None:
        from rhizome.v1 import tds_pb2

        try:
            got = list(self.client.logs(tds_pb2.LogsRequest(job_id=self.job_id, learner=0)))
        except ClientError:
            return  # the next poll tries again
        for line in got[self.seen :]:
            self.lines.append(line.line)
            stream = "" if line.stream == "stdout" else f" ({line.stream})"
            print(f"    learner 0{stream} | {line.line}", flush=True)
        self.seen = max(self.seen, len(got))


def run(data_dir: Path, backend: str) -> int:
    say(f"starting the embedded platform in {data_dir} (free ports, {backend} backend) ...")
    up = ["up", "--embedded", "--grpc-port", "0", "--rest-port", "0", "--backend", backend]
    if rhizome(data_dir, *up) != 0:
        say("the platform did not start; see the messages above")
        return 1
    state = load_state(data_dir)
    assert state is not None
    # The platform wrote an admin token into its data directory; the SDK reads it.
    with Client(state.api_address, data_dir=data_dir) as client:
        # 30 epochs instead of 10 (about 1 s each): long enough that the halt lands
        # while it trains, and the resume has epochs left to continue with.
        manifest = (EXAMPLE / "manifest.yml").read_text()
        # and batches of 8 (an epoch of ~0.1 s becomes ~1 s on a fast machine): the halt
        # must land while it trains, not after the last epoch
        manifest = manifest.replace("--epochs 10", f"--epochs {DEMO_EPOCHS} --batch-size 8")
        assert f"--epochs {DEMO_EPOCHS}" in manifest, "examples/mnist/manifest.yml changed"
        code = zip_directory(EXAMPLE)
        resp = client.create_job(manifest, code)
        job_id = resp.job_id
        say(f"submitted examples/mnist as job {job_id}")
        tail: LogTail | TdsTail = (
            TdsTail(client, job_id)
            if backend == "docker"
            else LogTail(data_dir / "jobs" / job_id / "learners" / "0")
        )
        seen = ""
        halted = halted_too_late = False
        started = time.monotonic()
        while time.monotonic() - started < TIMEOUT_S:
            try:
                job = client.get_job(job_id)
            except ClientError as exc:
                say(f"cannot read the job: {exc.message}")
                return 1
            status = _status_name(job.status)
            if status != seen:
                say(f"job {job_id} is {status} ({time.monotonic() - started:.1f}s)")
                seen = status
            tail.poll()
            if not halted and not halted_too_late and _epochs_done(tail.lines) >= HALT_AFTER_EPOCH:
                outcome = _halt_and_resume(client, job_id)
                if outcome == "failed":
                    return 1
                halted = outcome == "resumed"
                if outcome == "ended":
                    halted_too_late = True
                continue
            if status in TERMINAL:
                break
            time.sleep(0.3)
        tail.poll()
        resumed = [line for line in tail.lines if line.startswith("resuming from")]
        if halted and not resumed:
            say(
                "the resumed learner did not start from a checkpoint: examples/mnist saves one every epoch"
            )
            return 1
        if resumed:
            say(f"after the resume the learner said: {resumed[-1]!r}: no epoch was trained twice")
        if seen != "COMPLETED":
            say(f"the job ended {seen}: {job.status_message}")
            for line in job.last_log_lines:
                print(f"    {line}")
            return 1
        accuracy = _accuracy(data_dir, job_id, tail.lines)
        say(
            f"job {job_id} COMPLETED in {time.monotonic() - started:.1f}s; final test accuracy {accuracy}"
        )
        say("its history:")
        for entry in job.history:
            print(f"    {_status_name(entry.status):<12} {entry.message}")
    return 0


def _epochs_done(lines: list[str]) -> int:
    done = [int(line.split()[1].split("/")[0]) for line in lines if line.startswith("epoch ")]
    return max(done, default=0)


def _halt_and_resume(client: Client, job_id: str) -> str:
    """Halt the job (its learner stops; its checkpoint stays) and resume it: "resumed",
    "ended" (it finished before the halt took effect) or "failed"."""
    say(f"halting job {job_id} after epoch {HALT_AFTER_EPOCH} (its checkpoint is kept) ...")
    client.halt_job(job_id)
    deadline = time.monotonic() + 120
    while _status_name(client.get_job(job_id).status) not in TERMINAL:
        if time.monotonic() > deadline:
            say("the job did not halt within 120 s")
            return "failed"
        time.sleep(0.3)
    status = _status_name(client.get_job(job_id).status)
    if status != "HALTED":
        say(f"the job ended {status} before the halt took effect; no resume to show")
        return "ended" if status == "COMPLETED" else "failed"
    say(f"job {job_id} HALTED; resuming it: the learner should continue from the checkpoint")
    client.resume_job(job_id)
    return "resumed"


def _status_name(value: int) -> str:
    from rhizome.v1 import job_pb2

    return str(job_pb2.JobStatus.Name(value))  # type: ignore[arg-type]


def _accuracy(data_dir: Path, job_id: str, lines: list[str]) -> str:
    metrics = data_dir / "objects" / "results" / job_id / "0" / "metrics.json"
    if metrics.exists():
        return f"{json.loads(metrics.read_text())['test_accuracy']:.4f} (stored in {metrics})"
    finals = [line for line in lines if line.startswith("final test accuracy")]
    return finals[-1].split(":", 1)[1].strip() if finals else "unknown"


def main() -> int:
    backend = "local"
    if "--backend" in sys.argv[1:-1]:
        backend = sys.argv[sys.argv.index("--backend") + 1]
    data_dir = Path(tempfile.mkdtemp(prefix="rhizome-demo-"))
    os.environ.setdefault("RHIZOME_USER", "demo")
    code = 1
    try:
        code = run(data_dir, backend)
    except KeyboardInterrupt:
        code = 130
    except Exception as exc:
        say(f"failed: {type(exc).__name__}: {exc}")
    finally:
        say("stopping the platform ...")
        rhizome(data_dir, "down")
        if code == 0:
            shutil.rmtree(data_dir, ignore_errors=True)
        else:
            say(f"kept {data_dir} for a look at the logs")
    say("done" if code == 0 else "FAILED")
    return code


if __name__ == "__main__":
    sys.exit(main())
