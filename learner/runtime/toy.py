"""A tiny deterministic job (float64 MLP on synthetic data) for tests and smoke runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from learner.runtime.api import Batch, PipelineJob, RedundancyMode


def toy_layers(width: int = 8, depth: int = 4) -> list[nn.Module]:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, 1))
    return layers


def toy_batch(step: int, pipeline: int, microbatch: int, size: int = 4, width: int = 8) -> Batch:
    g = torch.Generator().manual_seed(1_000_003 * step + 7919 * pipeline + microbatch)
    x = torch.randn(size, width, generator=g, dtype=torch.float64)
    y = x.sum(dim=1, keepdim=True).sin()
    return x, y


def toy_job(
    steps: int = 3,
    microbatches: int = 3,
    redundancy: RedundancyMode | str = RedundancyMode.EAGER_FRC_LAZY_BRC,
    depth: int = 4,
    optimizer: str = "adam",
    schedule: str = "1f1b",
) -> PipelineJob:
    def opt(params: object) -> torch.optim.Optimizer:
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # type: ignore[arg-type]
        return torch.optim.Adam(params, lr=0.01)  # type: ignore[arg-type]

    return PipelineJob(
        build_layers=lambda: toy_layers(depth=depth),
        batch=toy_batch,
        loss_fn=nn.functional.mse_loss,
        optimizer=opt,
        steps=steps,
        microbatches=microbatches,
        redundancy=RedundancyMode.parse(redundancy),
        schedule=schedule,
        seed=0,
        dtype=torch.float64,
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m learner.runtime.launch ... learner/runtime/toy.py --steps 3``."""
    import argparse

    from learner.runtime.worker import train

    p = argparse.ArgumentParser(description="toy pipeline job (float64 MLP)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=3)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    p.add_argument("--redundancy", default=RedundancyMode.EAGER_FRC_LAZY_BRC.value)
    p.add_argument(
        "--gate",
        default="",
        help="testing: STEP:GEN[,...] — step STEP's batches wait until the runtime's "
        "generation is >= GEN (a replacement has joined), so a test orders events",
    )
    p.add_argument(
        "--die",
        default="",
        help="testing: W:S — worker W SIGKILLs itself in step S (on the platform, where the "
        "runtime's kill points are not passed); --die-replacement: only a replacement does",
    )
    p.add_argument("--die-replacement", default="")
    p.add_argument(
        "--hold",
        default="",
        help="testing: STEP:PATH — step STEP's batches wait until the file PATH exists (at "
        "most 300 s), so that a test acts on the job before it can finish",
    )
    p.add_argument(
        "--sleep",
        type=float,
        default=0.0,
        help="testing: seconds each batch load sleeps, so that a signal a test sends at "
        "step N lands while the run is still far from its end (the values are unchanged)",
    )
    p.add_argument(
        "--slow-optimizer",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="testing: seconds every optimizer step sleeps first, so that a replica's update "
        "is still being applied in the background when a failure lands (values unchanged)",
    )
    a = p.parse_args(argv)
    job = toy_job(
        steps=a.steps,
        microbatches=a.microbatches,
        redundancy=a.redundancy,
        depth=a.depth,
        optimizer=a.optimizer,
    )
    if a.slow_optimizer > 0:
        job.optimizer = slowed_optimizer(job.optimizer, a.slow_optimizer)
    if a.gate or a.die or a.die_replacement:
        job.batch = gated(job.batch, a.gate, a.die, a.die_replacement)
    if a.sleep > 0:
        job.batch = slowed(job.batch, a.sleep)
    if a.hold:
        step, _, path = a.hold.partition(":")
        job.batch = held(job.batch, int(step), path)
    train(job)


def held(
    batch: Callable[[int, int, int], Batch], step: int, path: str
) -> Callable[[int, int, int], Batch]:
    """``batch`` whose step ``step`` waits until the file ``path`` exists (``--hold``)."""
    import time
    from pathlib import Path

    def hold(at: int, pipeline: int, microbatch: int) -> Batch:
        if at == step:
            deadline = time.monotonic() + 300
            while not Path(path).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return batch(at, pipeline, microbatch)

    return hold


def slowed_optimizer(
    make: Callable[[Any], torch.optim.Optimizer], sleep_s: float
) -> Callable[[Any], torch.optim.Optimizer]:
    """``make`` whose optimizers sleep ``sleep_s`` before every step (``--slow-optimizer``)."""
    import time

    def slow(params: Any) -> torch.optim.Optimizer:
        opt = make(params)
        inner = opt.step

        def step(*args: Any, **kwargs: Any) -> Any:
            time.sleep(sleep_s)
            return inner(*args, **kwargs)

        opt.step = step  # type: ignore[method-assign]
        return opt

    return slow


def slowed(
    batch: Callable[[int, int, int], Batch], sleep_s: float
) -> Callable[[int, int, int], Batch]:
    """``batch`` that sleeps ``sleep_s`` first (``--sleep``)."""
    import time

    def slow(step: int, pipeline: int, microbatch: int) -> Batch:
        time.sleep(sleep_s)
        return batch(step, pipeline, microbatch)

    return slow


def _pairs(spec: str) -> dict[int, int]:
    return {int(a): int(b) for a, b in (part.split(":") for part in spec.split(",") if part)}


def gated(
    batch: Callable[[int, int, int], Batch], spec: str, die: str = "", die_replacement: str = ""
) -> Callable[[int, int, int], Batch]:
    """``batch`` for tests of reconfiguration: it holds the steps named in ``spec`` until
    the runtime's generation reaches the one named (at most 300 s: a loaded machine), so that a
    replacement, which needs seconds to start, joins before them; and it SIGKILLs this
    worker in the step ``die`` (or ``die_replacement``, for a replacement) names for it."""
    import os
    import signal
    import time

    from contract.env import RuntimeEnv
    from learner.runtime.cluster_state import EtcdClusterStateStore

    gates = _pairs(spec)
    env = RuntimeEnv.from_environ(os.environ)
    dies = _pairs(die_replacement if env.join_token else die)

    def wait(step: int, pipeline: int, microbatch: int) -> Batch:
        if dies.get(env.worker) == step:
            print(f"toy: worker {env.worker} SIGKILLs itself in step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if step in gates:
            store = EtcdClusterStateStore(env.etcd, env.job_id)
            try:
                deadline = time.monotonic() + 300
                while time.monotonic() < deadline:
                    state, _ = store.get_state()
                    if state is not None and state.generation >= gates[step]:
                        break
                    time.sleep(0.05)
            finally:
                store.close()
        return batch(step, pipeline, microbatch)

    return wait


if __name__ == "__main__":
    main()
