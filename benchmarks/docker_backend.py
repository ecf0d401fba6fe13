"""The docker backend against the local one, in one run (issue #13).

1. Latency: trivial jobs (`echo first_step $(date +%s.%N)`) submitted one at a time,
   first to a daemon with the local backend, then to one with the docker backend, on the
   same etcd, MongoDB-wire server and machine. Figures: submit → PROCESSING (client's
   submit call to the PROCESSING entry of the history) and deploy → first step (the
   DEPLOYING entry to the time the command printed), medians; the ratio docker / local.
2. Container start overhead: `containers.create` + `start` of the learner image with the
   backend's options (read-only, non-root, mounts, limits) until the first instruction of
   the container runs, vs the same command as a bare process; medians.
   A third daemon runs the docker backend with the S3 object store (`--object-store
   s3://...` on moto's server, started here): the code archive is uploaded to the bucket
   and each learner fetches it with job-scoped STS credentials the backend issues; the
   ratio docker+s3 / docker says what the object store costs a deploy.
3. Training throughput: the same CPU script as `overhead.py` (a small CNN, one thread,
   400 steps; it times its own loop), in rounds; each round runs, in a rotating order,
   - bare: `taskset -c CORE python -c TRAIN`;
   - container: the learner container exactly as the backend creates it
     (`services.backends.docker.spec.container_spec` for a job with `cpus: 1`,
     `memory: 2Gb`: read-only, non-root, capabilities dropped, seccomp, the mounts,
     `nano_cpus`), plus `cpuset_cpus=CORE`, running the same script;
   - container without the CPU quota (no `nano_cpus`): tells quota throttling apart;
   - job: a docker-backend job (`cpus: 1`) through the platform, controller included
     (not pinned: the backend has no cpuset setting).
   Figures: the per-round ratio to the same round's bare run (runs next to each other
   share the machine's load of the moment), median and spread (min-max) over the
   rounds. Goal ≥ 0.98.

    .venv/bin/python benchmarks/docker_backend.py [--jobs 5] [--rounds 7] [--core N]

Uses DOCKER_HOST's engine, else starts its own dockerd under /tmp (stopped at the end).
"""

from __future__ import annotations

import argparse
import io
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from _platform import ROOT  # noqa: F401  (puts the repository on sys.path)
from overhead import TRAIN

from contract.procs import free_port
from services.backends.docker.spec import ContainerOptions, container_spec
from services.client.sdk import Client
from services.embedded.docker_engine import DockerEngine
from services.embedded.platform import DaemonServer
from services.embedded.servers import EtcdServer, MongoServer
from services.images.build import build_offline, image_exists, learner_tag
from services.store.jobs import JobsRepository
from services.store.mongo import connect

FIRST_STEP = 'echo "first_step $(date +%s.%N)"'
ARMS = ("bare", "container", "container, no quota", "job")


def manifest(name: str, command: str, cpus: float = 1) -> str:
    return f"name: {name}\ncpus: {cpus}\nmemory: 2Gb\nframework:\n  command: {command!r}\n"


def code(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return buf.getvalue()


class MotoS3:
    """moto's S3/IAM/STS server on a free port, stopped by pid (the test server)."""

    def __init__(self) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        binary = Path(sys.executable).parent / "moto_server"
        port = self.url.rsplit(":", 1)[1]
        self.proc = subprocess.Popen(
            [str(binary), "-H", "127.0.0.1", "-p", port],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url, timeout=1).close()
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise SystemExit("moto_server did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        import os
        import signal

        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=10)


class Daemon:
    def __init__(
        self,
        data_dir: Path,
        etcd: str,
        mongo: str,
        backend: str,
        engine: str,
        extra: tuple[str, ...] = (),
    ) -> None:
        args = [f"--mongodb-uri={mongo}", f"--etcd={etcd}", "--services=api,lcm"]
        args += [f"--backend={backend}", f"--docker-host={engine}", *extra]
        args += [f"--admin-token-file={data_dir / 'admin.token'}"]
        self.data_dir = data_dir
        self.server = DaemonServer(data_dir, free_port(), free_port(), args)
        self.server.start_timeout_s = 60

    def __enter__(self) -> Daemon:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(timeout_s=30)

    @property
    def api(self) -> str:
        return self.server.url

    def token(self) -> str:
        return (self.data_dir / "admin.token").read_text().strip()


def wait_end(repo: JobsRepository, job_id: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = repo.get(job_id)
        if record.status in ("COMPLETED", "FAILED", "DELETED", "HALTED"):
            if record.status != "COMPLETED":
                raise SystemExit(f"job {job_id} ended {record.status}: {record.status_message}")
            return
        time.sleep(0.1)
    raise SystemExit(f"job {job_id} did not end in {timeout_s}s")


# A docker-backend learner's output goes to its container's streams (shipped to the TDS,
# which these daemons do not run), so the commands also keep it in the job directory.
KEEP = ' | tee -a "$RHIZOME_JOB_DIR/out.txt"'


def stdout_of(daemon: Daemon, job_id: str) -> str:
    return (daemon.data_dir / "jobs" / job_id / "out.txt").read_text()


def latency(daemon: Daemon, client: Client, repo: JobsRepository) -> tuple[float, float]:
    t0 = time.time()
    job_id = client.create_job(manifest("latency", FIRST_STEP + KEEP), code({"x": ""})).job_id
    wait_end(repo, job_id)
    history = {h.status: h.time for h in reversed(repo.get(job_id).history)}
    first = float(re.search(r"first_step ([\d.]+)", stdout_of(daemon, job_id)).group(1))  # type: ignore[union-attr]
    return history["PROCESSING"] - t0, first - history["DEPLOYING"]


def throughput_of(text: str) -> float:
    return float(re.search(r"throughput=([\d.]+)", text).group(1))  # type: ignore[union-attr]


def bare_throughput(core: int) -> float:
    out = subprocess.run(
        ["taskset", "-c", str(core), sys.executable, "-c", TRAIN],
        capture_output=True,
        text=True,
        check=True,
    )
    return throughput_of(out.stdout)


def learner_container_kwargs(image: str, scratch: Path, core: int, quota: bool) -> dict[str, Any]:
    """The backend's own container arguments for a `cpus: 1`, `memory: 2Gb` learner,
    with the training script as the command and pinned to `core`."""
    from services.backends.api import JobSpec
    from services.manifest import parse_manifest

    job_dir = scratch / "tput-job"
    (job_dir / "learners" / "0").mkdir(parents=True, exist_ok=True)
    job = JobSpec(
        job_id="tput",
        command="python train.py",
        learners=1,
        job_dir=str(job_dir),
        checkpoint_dir=str(job_dir / "checkpoints"),
        result_store="",
        etcd_url="",
        manifest=parse_manifest(manifest("tput", "python train.py")),
        memory_mb=2048,
    )
    spec_path = str(job_dir / "learners" / "0" / "spec.json")
    kwargs = container_spec(job, 0, 0, spec_path, ContainerOptions(image=image), image=image)
    kwargs.pop("name")
    kwargs["command"] = ["python", "-c", TRAIN]
    kwargs["cpuset_cpus"] = str(core)
    kwargs["labels"] = {"rhizome.bench": "1"}
    if not quota:
        kwargs.pop("nano_cpus", None)
    return kwargs


def container_throughput(client: Any, kwargs: dict[str, Any]) -> float:
    container = client.containers.create(**kwargs)
    try:
        container.start()
        result = container.wait()
        text = container.logs().decode()
        if result.get("StatusCode") != 0:
            raise SystemExit(f"the training container exited {result}: {text[-500:]}")
        return throughput_of(text)
    finally:
        container.remove(force=True)


def container_start(client: object, image: str, scratch: Path) -> tuple[float, float]:
    """(create → first instruction, whole run incl. removal) of one learner-like container."""
    import docker

    assert isinstance(client, docker.DockerClient)
    options = ContainerOptions(image=image)
    t0 = time.time()
    container = client.containers.create(
        image,
        ["/bin/sh", "-c", "date +%s.%N"],
        user=f"{options.uid}:{options.gid}",
        read_only=True,
        network_mode="host",
        mounts=options.code_mounts,
        environment=options.base_env,
        tmpfs={"/tmp": "size=64m"},
        init=True,
        cap_drop=["ALL"],
        mem_limit="512m",
        nano_cpus=1_000_000_000,
        pids_limit=4096,
        labels={"rhizome.bench": "1"},
    )
    container.start()
    container.wait()
    first = float(container.logs().decode().strip())
    container.remove(force=True)
    return first - t0, time.time() - t0


def bare_start() -> float:
    t0 = time.time()
    out = subprocess.run(["/bin/sh", "-c", "date +%s.%N"], capture_output=True, text=True)
    return float(out.stdout.strip()) - t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=5, help="latency jobs per backend")
    parser.add_argument("--rounds", type=int, default=7, help="throughput rounds (every arm once)")
    parser.add_argument(
        "--core", type=int, default=0, help="the core bare and container runs share"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rzbench-", dir="/tmp"))
    engine = DockerEngine(work / "e")
    etcd = EtcdServer(work / "etcd")
    mongo = MongoServer(work / "mongo")
    s3: MotoS3 | None = None
    try:
        import os

        import boto3

        s3 = MotoS3()
        # The daemon's (platform) credentials; moto accepts any until IAM is enforced.
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
        )
        boto3.client("s3", endpoint_url=s3.url).create_bucket(Bucket="bench")
        engine.start()
        etcd.start()
        mongo.start()
        docker_client = engine.client()
        if not image_exists(docker_client, learner_tag()):
            build_offline(docker_client, lambda m: print(f"  {m}", file=sys.stderr))
        repo = JobsRepository(connect(mongo.url))
        lat: dict[str, list[tuple[float, float]]] = {}
        runs: dict[str, list[float]] = {arm: [] for arm in ARMS}
        variants = {
            "local": ("local", ()),
            "docker": ("docker", ()),
            "docker+s3": (
                "docker",
                ("--object-store=s3://bench/rz", f"--object-store-endpoint={s3.url}"),
            ),
        }
        for variant, (backend, extra) in variants.items():
            data_dir = work / variant.replace("+", "-")
            with (
                Daemon(data_dir, etcd.url, mongo.url, backend, engine.url, extra) as daemon,
                Client(daemon.api, token=daemon.token()) as client,
            ):
                latency(daemon, client, repo)  # warm-up: first imports, first index use
                lat[variant] = [latency(daemon, client, repo) for _ in range(args.jobs)]
                if variant == "docker":
                    pinned = learner_container_kwargs(learner_tag(), work, args.core, quota=True)
                    free = learner_container_kwargs(learner_tag(), work, args.core, quota=False)

                    def job_run() -> float:
                        job_id = client.create_job(
                            manifest("throughput", "python train.py" + KEEP),
                            code({"train.py": TRAIN}),
                        ).job_id
                        wait_end(repo, job_id)
                        return throughput_of(stdout_of(daemon, job_id))

                    arms: dict[str, Callable[[], float]] = {
                        "bare": lambda: bare_throughput(args.core),
                        "container": partial(container_throughput, docker_client, pinned),
                        "container, no quota": partial(container_throughput, docker_client, free),
                        "job": job_run,
                    }
                    for warm_up in arms.values():  # page cache, first imports
                        warm_up()
                    for r in range(args.rounds):
                        order = list(ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)])
                        for arm_name in order:
                            runs[arm_name].append(arms[arm_name]())
                        print(
                            f"  round {r + 1}/{args.rounds}: "
                            + ", ".join(f"{a} {runs[a][-1]:.0f}" for a in ARMS),
                            file=sys.stderr,
                        )
        container_start(docker_client, learner_tag(), work)  # warm-up
        starts = [container_start(docker_client, learner_tag(), work) for _ in range(args.jobs)]
        bares = [bare_start() for _ in range(args.jobs)]
        docker_client.close()
    finally:
        mongo.stop()
        etcd.stop()
        engine.stop()
        if s3 is not None:
            s3.stop()
        shutil.rmtree(work, ignore_errors=True)

    def med(values: list[float]) -> float:
        return statistics.median(values)

    sub = {b: med([v[0] for v in lat[b]]) for b in lat}
    dep = {b: med([v[1] for v in lat[b]]) for b in lat}
    print("| measure | local backend | docker backend | docker / local | goal |")
    print("| --- | --- | --- | --- | --- |")
    print(
        f"| submit → PROCESSING (s, median of {args.jobs}) | {sub['local']:.2f} "
        f"| {sub['docker']:.2f} | {sub['docker'] / sub['local']:.2f}x | – |"
    )
    print(
        f"| deploy → first step (s, median of {args.jobs}) | {dep['local']:.2f} "
        f"| {dep['docker']:.2f} | {dep['docker'] / dep['local']:.2f}x | – |"
    )
    print()
    print(
        "| measure | docker, code on a volume | docker, code and credentials via S3 | s3 / volume |"
    )
    print("| --- | --- | --- | --- |")
    print(
        f"| submit → PROCESSING (s, median of {args.jobs}) | {sub['docker']:.2f} "
        f"| {sub['docker+s3']:.2f} | {sub['docker+s3'] / sub['docker']:.2f}x |"
    )
    print(
        f"| deploy → first step (s, median of {args.jobs}) | {dep['docker']:.2f} "
        f"| {dep['docker+s3']:.2f} | {dep['docker+s3'] / dep['docker']:.2f}x |"
    )
    print()
    print("| measure | bare process | learner container | overhead |")
    print("| --- | --- | --- | --- |")
    first = med([s[0] for s in starts])
    whole = med([s[1] for s in starts])
    print(
        f"| start → first instruction (s, median of {args.jobs}) | {med(bares):.3f} "
        f"| {first:.3f} | +{first - med(bares):.3f} s |"
    )
    print(f"| create → exit → removed (s, median of {args.jobs}) | – | {whole:.3f} | – |")
    print()
    bare = runs["bare"]
    print(
        f"| training throughput, {args.rounds} rounds (samples/s, median) | runs | "
        "ratio to the same round's bare run: median (min-max) | goal |"
    )
    print("| --- | --- | --- | --- |")
    for arm in ARMS:
        ratios = [v / b for v, b in zip(runs[arm], bare, strict=True)]
        goal = ""
        if arm != "bare":
            goal = f"≥ 0.98 ({'met' if med(ratios) >= 0.98 else 'NOT met'})"
        print(
            f"| {arm} | {med(runs[arm]):.0f} | {med(ratios):.3f} "
            f"({min(ratios):.3f}-{max(ratios):.3f}) | {goal} |"
        )
    spread = max(bare) / min(bare)
    print(f"bare runs alone spread {spread:.2f}x (max/min): the machine's noise")
    for arm in ARMS:
        print(f"{arm} runs: {[round(v) for v in runs[arm]]}")
    for backend in lat:
        print(
            f"{backend}: submit→PROCESSING {[round(v[0], 2) for v in lat[backend]]}, "
            f"deploy→first step {[round(v[1], 2) for v in lat[backend]]}"
        )


if __name__ == "__main__":
    main()
