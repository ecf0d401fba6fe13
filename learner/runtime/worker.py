"""What a training script calls: ``learner.runtime.train(job)``.

It reads its ``RuntimeEnv`` (``RHIZOME_RUNTIME_*``, contract/env.py: written by the
launcher, or on the platform by the learner controller of a pipeline job), connects to
etcd and the rendezvous store (the launcher's TCPStore, or with ``STORE=etcd`` the
platform's etcd, learner/runtime/etcd_store.py), and runs one ``Worker``. It never returns
normally: the process exits with 0 on success, ``ExitCode.FATAL`` (3) on a fatal loss
(one ``FATAL:`` line on stderr), ``ExitCode.PREEMPTED`` (143) when it left on a
preemption notice (halt.py: after the emergency block save of a halt, or alone; one
``PREEMPTED:`` line), ``ExitCode.EVICTED`` (4) when evicted or, as a
replacement (``JOIN_TOKEN`` set), refused admission (one ``REFUSED:`` line), and
``ExitCode.CONFIG_ERROR`` (one line naming the variable) when a variable is missing or
malformed. It exits with ``os._exit`` because a survivor may still hold abandoned gloo
waits in daemon threads, which would otherwise abort the interpreter at shutdown.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from contract.env import ETCD_STORE, NOTICE_SOURCES, LearnerConfigError, LearnerEnv, RuntimeEnv
from contract.status import ExitCode
from learner.checkpoint.api import NoticeSourceError
from learner.checkpoint.notices import NoticeBoard
from learner.runtime.allocator import one_malloc_arena
from learner.runtime.api import (
    EXIT_EVICTED,
    EXIT_FATAL,
    EXIT_PREEMPTED,
    ConfigError,
    Evicted,
    FatalFailure,
    PipelineJob,
    Preempted,
    RedundancyMode,
)
from learner.runtime.cluster_state import EtcdClusterStateStore
from learner.runtime.comm import route_address
from learner.runtime.engine import KillPoint, Worker, WorkerOptions
from learner.runtime.etcd_store import EtcdStore
from learner.runtime.reconfigure import Refused, admit


def options_from_env(env: RuntimeEnv) -> WorkerOptions:
    try:
        kill = KillPoint.parse(env.kill)
    except ConfigError as exc:
        raise LearnerConfigError(RuntimeEnv.var("kill"), f"={env.kill!r}: {exc}") from None
    return WorkerOptions(
        worker=env.worker,
        stages=env.stages,
        pipelines=env.pipelines,
        backend=env.backend,
        address=rendezvous_route(env),
        device=env.resolved_device,
        detection_timeout_s=env.detection_timeout_s,
        lease_ttl_s=env.lease_ttl_s,
        out_dir=env.out_dir,
        kill=kill,
        join_token=env.join_token,
        checkpoint_dir=env.checkpoint_dir,
        checkpoint_every=env.checkpoint_every,
        metrics_file=env.metrics_file,
        metrics_every=env.metrics_every,
    )


def rendezvous_route(env: RuntimeEnv) -> str:
    """This worker's own address: the one on its route to the rendezvous store (the
    launcher's TCPStore, or etcd on the platform), which its peers reach too."""
    if env.store != ETCD_STORE:
        host = env.store.rpartition(":")[0]
    else:
        host = urlsplit(env.etcd).hostname or "127.0.0.1"
    try:
        return route_address(host.strip("[]"))
    except OSError as exc:
        raise LearnerConfigError(
            RuntimeEnv.var("store"), f": no route to the rendezvous host {host!r} ({exc})"
        ) from None


def _config_error(exc: LearnerConfigError) -> None:
    print(f"rhizome-runtime: {exc}", file=sys.stderr, flush=True)
    os._exit(ExitCode.CONFIG_ERROR)


def train(job: PipelineJob) -> None:
    """Run this process's worker of ``job`` and exit the process with its outcome."""
    # before any thread of the runtime allocates (allocator.py: page faults every step)
    one_malloc_arena()
    try:
        env = RuntimeEnv.from_environ(os.environ)
        opts = options_from_env(env)
        if env.redundancy:
            try:
                job.redundancy = RedundancyMode.parse(env.redundancy)
            except ConfigError as exc:
                raise LearnerConfigError(
                    RuntimeEnv.var("redundancy"), f"={env.redundancy!r}: {exc}"
                ) from None
        if env.microbatches:
            job.microbatches = env.microbatches  # checked with the rest by job.validate
        # the checkpoint layer's notice sources and priors (RHIZOME_NOTICE_SOURCES,
        # RHIZOME_GRACE_S, RHIZOME_SAVE_S: contract/env.py LearnerEnv)
        learner_env = LearnerEnv.from_environ(os.environ)
        try:
            board = NoticeBoard.from_env(learner_env)
        except NoticeSourceError as exc:
            raise LearnerConfigError(NOTICE_SOURCES, f": {exc}") from None
    except LearnerConfigError as exc:
        _config_error(exc)
        return
    torch.set_num_threads(env.resolved_threads)
    if opts.device.startswith("cuda:"):
        # the launcher's one GPU per worker (launch.worker_device): NCCL's communicators
        # and the CUDA context go there, not to GPU 0 of every worker
        torch.cuda.set_device(opts.device)
    store: dist.Store
    if env.store == ETCD_STORE:  # on the platform: kept in etcd, no process hosts it
        store = EtcdStore(env.etcd, env.job_id, timeout=timedelta(seconds=60))
    else:  # under the launcher: its TCPStore
        host, _, port = env.store.rpartition(":")
        store = dist.TCPStore(host, int(port), None, False, timeout=timedelta(seconds=60))
    cluster = EtcdClusterStateStore(env.etcd, env.job_id)
    code = 0
    try:
        if opts.join_token is not None:
            # The first optimizer of a process imports torch._dynamo (seconds): paid here,
            # before admission, not while the running workers wait for this one.
            job.optimizer([torch.nn.Parameter(torch.zeros(1))])
            # a replacement: wait for (or take) a lost slot, then run as that worker
            opts.worker = admit(
                cluster,
                opts.worker,
                opts.join_token,
                opts.lease_ttl_s,
                log=lambda m: print(f"[worker {env.worker}] {m}", file=sys.stderr, flush=True),
            )
            # admitted into a grown job's new pipeline: the slot is beyond the D asked for
            state, _ = cluster.get_state()
            if state is not None and state.pipelines > opts.pipelines:
                opts.pipelines = state.pipelines
        # From the main thread (Python delivers SIGTERM only there), and only once this
        # process is a worker: a standby still queued is ended by a SIGTERM as before (a
        # halt must not wait out the grace for a process that holds nothing).
        board.start()
        Worker(job, opts, cluster, store, board, learner_env.save_s).run()
    except Refused as exc:
        print(f"REFUSED: {exc}", file=sys.stderr, flush=True)
        code = EXIT_EVICTED
    except FatalFailure as exc:
        print(f"FATAL: {exc}", file=sys.stderr, flush=True)
        code = EXIT_FATAL
    except Evicted as exc:
        print(f"EVICTED: {exc}", file=sys.stderr, flush=True)
        code = EXIT_EVICTED
    except Preempted as exc:
        print(f"PREEMPTED: {exc}", file=sys.stderr, flush=True)
        code = EXIT_PREEMPTED
    except Exception as exc:
        print(f"ERROR: worker {opts.worker}: {exc!r}", file=sys.stderr, flush=True)
        code = 1
    finally:
        try:
            cluster.close()
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
