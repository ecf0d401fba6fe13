"""What a training script calls: ``learner.runtime.train(job)``.

Under the launcher it reads ``RHIZOME_RUNTIME_*``, connects to etcd and the launcher's
TCPStore, and runs one ``Worker``. It never returns normally: the process exits with 0
on success, 3 on a fatal loss (one ``FATAL:`` line on stderr), 4 when evicted. It exits
with ``os._exit`` because a survivor may still hold abandoned gloo waits in daemon
threads, which would otherwise abort the interpreter at shutdown.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from learner.runtime.api import (
    EXIT_EVICTED,
    EXIT_FATAL,
    ConfigError,
    Evicted,
    FatalFailure,
    PipelineJob,
    RedundancyMode,
)
from learner.runtime.cluster_state import EtcdClusterStateStore
from learner.runtime.engine import KillPoint, Worker, WorkerOptions

ENV = "RHIZOME_RUNTIME_"


def _env(name: str, default: str | None = None) -> str:
    value = os.environ.get(ENV + name, default)
    if value is None:
        raise ConfigError(
            f"{ENV}{name} is not set: start this script with "
            "`python -m learner.runtime.launch --stages P --pipelines D script.py`"
        )
    return value


def options_from_env() -> WorkerOptions:
    return WorkerOptions(
        worker=int(_env("WORKER")),
        stages=int(_env("STAGES")),
        pipelines=int(_env("PIPELINES")),
        backend=_env("BACKEND", "gloo"),
        device=_env("DEVICE", "cuda" if _env("BACKEND", "gloo") == "nccl" else "cpu"),
        detection_timeout_s=float(_env("DETECTION_TIMEOUT", "10")),
        lease_ttl_s=float(_env("LEASE_TTL", "2")),
        out_dir=os.environ.get(ENV + "OUT_DIR") or None,
        kill=KillPoint.parse(_env("KILL", "")),
    )


def train(job: PipelineJob) -> None:
    """Run this process's worker of ``job`` and exit the process with its outcome."""
    torch.set_num_threads(int(os.environ.get(ENV + "THREADS", "1")))
    opts = options_from_env()
    if os.environ.get(ENV + "REDUNDANCY"):
        job.redundancy = RedundancyMode.parse(os.environ[ENV + "REDUNDANCY"])
    host, _, port = _env("STORE").rpartition(":")
    store = dist.TCPStore(host, int(port), None, False, timeout=timedelta(seconds=60))
    cluster = EtcdClusterStateStore(_env("ETCD"), _env("JOB_ID"))
    code = 0
    try:
        Worker(job, opts, cluster, store).run()
    except FatalFailure as exc:
        print(f"FATAL: {exc}", file=sys.stderr, flush=True)
        code = EXIT_FATAL
    except Evicted as exc:
        print(f"EVICTED: {exc}", file=sys.stderr, flush=True)
        code = EXIT_EVICTED
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
