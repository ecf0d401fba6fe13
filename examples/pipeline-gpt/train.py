"""A small GPT-style model trained pipeline-parallel on corpus.txt (character level).

    python -m learner.runtime.launch --stages 2 --pipelines 1 \\
        examples/pipeline-gpt/train.py --steps 40

or on the platform, one worker per learner: ``rhizome train examples/pipeline-gpt/manifest.yaml``.

The model is given to the runtime as a sequence of modules (embedding, transformer
blocks, head) so it can be cut into stages anywhere between them.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch import nn

from learner.runtime import PipelineJob, RedundancyMode, train

CORPUS = Path(__file__).with_name("corpus.txt")


class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class CharData:
    def __init__(self, text: str, context: int, batch: int) -> None:
        self.chars = sorted(set(text))
        self.ids = torch.tensor([self.chars.index(c) for c in text], dtype=torch.long)
        self.context, self.batch = context, batch

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def __call__(
        self, step: int, pipeline: int, microbatch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # deterministic in (step, pipeline, microbatch): a redone step sees the same samples
        g = torch.Generator().manual_seed(step * 100_003 + pipeline * 1009 + microbatch)
        starts = torch.randint(0, len(self.ids) - self.context - 1, (self.batch,), generator=g)
        x = torch.stack([self.ids[s : s + self.context] for s in starts.tolist()])
        y = torch.stack([self.ids[s + 1 : s + 1 + self.context] for s in starts.tolist()])
        return x, y


def gpt_job(
    steps: int = 40,
    microbatches: int = 4,
    dim: int = 64,
    layers: int = 4,
    heads: int = 4,
    context: int = 64,
    batch: int = 8,
    redundancy: str = RedundancyMode.EAGER_FRC_LAZY_BRC.value,
) -> PipelineJob:
    data = CharData(CORPUS.read_text(), context, batch)

    def build() -> list[nn.Module]:
        return [
            Embed(data.vocab, dim, context),
            *[Block(dim, heads) for _ in range(layers)],
            Head(dim, data.vocab),
        ]

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    return PipelineJob(
        build_layers=build,
        batch=data,
        loss_fn=loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        steps=steps,
        microbatches=microbatches,
        redundancy=RedundancyMode.parse(redundancy),
        seed=0,
        dtype=torch.float32,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--redundancy", default=RedundancyMode.EAGER_FRC_LAZY_BRC.value)
    a = p.parse_args()
    job = gpt_job(a.steps, a.microbatches, a.dim, a.layers, redundancy=a.redundancy)
    print(f"# uniform-guess loss is {math.log(CharData(CORPUS.read_text(), 8, 1).vocab):.3f}")
    train(job)


if __name__ == "__main__":
    main()
