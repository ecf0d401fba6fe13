"""Elastic data-parallel training (Amoeba): workers join and leave a running job at
mini-batch boundaries; see docs/elastic.md.

```python
from learner import elastic

job = elastic.join(model, optimizer, dataset, batch_size=32, etcd="http://127.0.0.1:2379")
for x, y in job.batches(epochs=2):
    job.step(F.cross_entropy(model(x), y))
job.close()
```
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from contract.env import ELASTIC_ETCD, JOB_ID, RANK, elastic_worker_name
from learner.elastic.api import (
    ElasticConfigError,
    ElasticError,
    ElasticJob,
    RemovedFromJob,
    StaleGeneration,
)

__all__ = [
    "ElasticConfigError",
    "ElasticError",
    "ElasticJob",
    "RemovedFromJob",
    "StaleGeneration",
    "join",
]


def join(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: Sequence[Any],
    *,
    batch_size: int,
    etcd: str | None = None,
    job_id: str | None = None,
    **options: Any,
) -> ElasticJob:
    """Join the job (call it once the model, optimizer and data set are built: the others
    train meanwhile) and return when this worker is a member holding the job's current
    state. `etcd` defaults to `RHIZOME_ELASTIC_ETCD`, `job_id` to `RHIZOME_JOB_ID`; other
    options: learner/elastic/worker.py `ElasticWorker`. SIGTERM leaves at the next
    mini-batch boundary."""
    from learner.elastic.worker import ElasticWorker  # torch.distributed only when used

    url = etcd or os.environ.get(ELASTIC_ETCD, "")
    if not url:
        raise ElasticConfigError(f"no etcd URL: pass etcd='http://HOST:PORT' or set {ELASTIC_ETCD}")
    rank = os.environ.get(RANK, "")
    if options.get("worker") is None and rank.isdigit():
        # on the platform: the guardian knows a scale-out's learner by this name
        options["worker"] = elastic_worker_name(int(rank))
    worker = ElasticWorker(
        model,
        optimizer,
        dataset,
        batch_size=batch_size,
        job_id=job_id or os.environ.get(JOB_ID, ""),
        etcd=url,
        **options,
    )
    worker.handle_sigterm()
    return worker
