"""Without failures, a pipeline run ends with the reference's parameters (in-process runs).

All P x D workers run as threads of the test process with real gloo groups and the
in-memory cluster state (``learner.runtime.inprocess``); the multi-process runs through
the launcher are in ``test_failover.py``.
"""

from __future__ import annotations

import pytest
import torch

from learner.runtime.api import ConfigError, RedundancyMode
from learner.runtime.inprocess import merge_params, run_in_process
from learner.runtime.reference import reference_train
from learner.runtime.toy import toy_job


def assert_matches_reference(
    per_worker: list[dict[str, torch.Tensor]], ref: dict[str, torch.Tensor]
) -> None:
    merged = merge_params(per_worker)
    assert set(merged) == set(ref)
    for key, copies in merged.items():
        for copy in copies:
            torch.testing.assert_close(copy, ref[key], rtol=1e-9, atol=1e-11, msg=key)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.mark.parametrize("mode", list(RedundancyMode))
@pytest.mark.parametrize("pipelines", [1, 2])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_pipeline_equals_single_process_reference(
    stages: int, pipelines: int, mode: RedundancyMode
) -> None:
    job = toy_job(steps=2, microbatches=3, redundancy=mode)
    got = run_in_process(job, stages, pipelines, verbose=False)
    assert_matches_reference(got, reference_train(job, pipelines))


def test_gpipe_order_with_sgd_momentum_matches_reference() -> None:
    job = toy_job(steps=3, microbatches=4, optimizer="sgd", schedule="gpipe")
    got = run_in_process(job, 3, 1, verbose=False)
    assert_matches_reference(got, reference_train(job, 1))


def test_the_run_differs_from_an_untrained_model() -> None:
    # guards the equality check itself: training must actually move the parameters
    job = toy_job(steps=2)
    trained = merge_params(run_in_process(job, 2, 1, verbose=False))
    untrained = reference_train(job, 1, steps=0)
    assert any(not torch.allclose(trained[k][0], untrained[k]) for k in untrained)


def test_bad_redundancy_mode_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="eager-frc-lazy-brc"):
        toy_job(redundancy="eager")
