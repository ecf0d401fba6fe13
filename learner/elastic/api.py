"""The elastic data-parallel interface (docs/elastic.md): what a training script holds
and the typed errors it may see.

A script joins the job once it has built everything (model, optimizer, data set), so a
joiner's preparation overlaps the others' training; the others stop only at the
mini-batch boundary where the group re-forms and hands the state over.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any

import torch


class ElasticError(RuntimeError):
    """Base of every error of learner/elastic/."""


class ElasticConfigError(ElasticError, ValueError):
    """A bad argument or environment; the message names it and how to fix it."""


class StaleGeneration(ElasticError):
    """A joiner asked to join a generation that is no longer current: its view of the job
    is out of date. `join()` re-reads and asks again; the low-level call raises this."""


class RemovedFromJob(ElasticError):
    """This worker is no longer a member (declared dead or a straggler while it was away);
    its state is stale, so it must stop rather than train on."""


class ElasticJob(abc.ABC):
    """One worker's handle on an elastic data-parallel job.

    ```python
    job = elastic.join(model, optimizer, dataset, batch_size=32)
    for x, y in job.batches(epochs=2):
        job.step(F.cross_entropy(model(x), y))
    job.close()
    ```
    """

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """This worker's name in the job (its etcd keys, its rank order)."""

    @property
    @abc.abstractmethod
    def step_count(self) -> int:
        """Mini-batches the job has completed (never goes back, across any re-form)."""

    @property
    @abc.abstractmethod
    def epoch(self) -> int: ...

    @property
    @abc.abstractmethod
    def generation(self) -> int:
        """The membership generation this worker trains in."""

    @property
    @abc.abstractmethod
    def members(self) -> list[str]:
        """The workers of the current generation, in rank order."""

    @abc.abstractmethod
    def batches(self, epochs: int) -> Iterator[Any]:
        """This worker's mini-batches until `epochs` epochs are done; each must be
        followed by one `step(loss)`."""

    @abc.abstractmethod
    def step(self, loss: torch.Tensor) -> None:
        """Backward, average the gradients over every sample of the step, optimizer step;
        at the boundary re-form the group if members join or leave."""

    @abc.abstractmethod
    def leave(self, reason: str = "requested") -> None:
        """Leave gracefully at the end of the current mini-batch (nothing is lost)."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, data plan and step: a checkpoint that continues the epoch."""

    @abc.abstractmethod
    def close(self) -> None:
        """Leave (if still a member) and release every resource."""
