"""Block checkpoints: exact save/load, the latest complete step, pruning of old saves."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from learner.runtime import block_checkpoint
from learner.runtime.worker_state import BlockState


def _block(index: int, seed: int) -> BlockState:
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(3, 3))
    blk = BlockState(index, module, torch.optim.Adam(module.parameters(), lr=0.1))
    module(torch.randn(2, 3)).sum().backward()
    blk.optimizer.step()  # optimizer state exists
    return blk


def test_a_saved_block_loads_back_exactly(tmp_path: Path) -> None:
    saved = _block(0, seed=1)
    saved.version = 7
    block_checkpoint.save(str(tmp_path), [saved], 7)
    other = _block(0, seed=2)
    block_checkpoint.load(str(tmp_path), other, 7)
    assert other.version == 7
    for a, b in zip(saved.params, other.params, strict=True):
        assert torch.equal(a, b)
    sa, sb = saved.optimizer.state_dict()["state"], other.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"]) for k in sa)


def test_the_latest_complete_step_needs_every_block(tmp_path: Path) -> None:
    assert block_checkpoint.latest_complete(str(tmp_path / "none"), 2) is None
    b0, b1 = _block(0, 1), _block(1, 1)
    block_checkpoint.save(str(tmp_path), [b0, b1], 10)
    block_checkpoint.save(str(tmp_path), [b0], 20)  # block 1 has not saved step 20 yet
    assert block_checkpoint.latest_complete(str(tmp_path), 2) == 10
    block_checkpoint.save(str(tmp_path), [b1], 20)
    assert block_checkpoint.latest_complete(str(tmp_path), 2) == 20


def test_only_the_two_newest_saves_of_a_block_stay(tmp_path: Path) -> None:
    b0 = _block(0, 1)
    for step in (10, 20, 30):
        block_checkpoint.save(str(tmp_path), [b0], step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["block0-step20.pt", "block0-step30.pt"]
