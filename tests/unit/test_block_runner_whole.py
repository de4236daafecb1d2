"""Blocks the memory plan keeps whole (``BlockRunners.whole``): run as they are, never recomputed, and the same
gradients bit for bit as when every block is checkpointed (on the CPU in fp32 the recompute runs the same kernels
on the same values, and the backward adds the same terms in the same order)."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from dataset_cache.block_runner import BlockRunners

DIM = 8


class Block(nn.Module):
    """Counts its forward runs (a checkpointed block runs twice a step: forward and recompute)."""

    def __init__(self, index: int, runs: Counter[int], gen: torch.Generator) -> None:
        super().__init__()
        self.index, self.runs = index, runs
        self.fc1 = nn.Linear(DIM, DIM)
        self.fc2 = nn.Linear(DIM, DIM)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        self.runs[self.index] += 1
        return x + self.fc2(torch.tanh(self.fc1(x + emb))) * (1.0 + emb)


def _step(whole: set[int]) -> tuple[Counter[int], list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    runs: Counter[int] = Counter()
    blocks = [Block(i, runs, gen) for i in range(4)]
    x = torch.randn(2, DIM, generator=gen)
    emb = torch.randn(1, DIM, generator=gen).requires_grad_(True)
    runners = BlockRunners(blocks, checkpoint=True)
    runners.whole = whole
    try:
        h = x
        for b in blocks:
            h = b(h, emb)
        h.square().mean().backward()
    finally:
        runners.remove()
    assert emb.grad is not None
    return runs, [p.grad for b in blocks for p in b.parameters()], emb.grad


def test_a_block_kept_whole_runs_once_and_trains_bit_for_bit_as_checkpointed() -> None:
    runs_all, grads_all, emb_all = _step(set())
    runs_kept, grads_kept, emb_kept = _step({1, 3})
    assert runs_all == {0: 2, 1: 2, 2: 2, 3: 2}  # forward and recompute
    assert runs_kept == {0: 2, 1: 1, 2: 2, 3: 1}  # the kept blocks are not recomputed
    assert all(torch.equal(a, b) for a, b in zip(grads_all, grads_kept, strict=True))
    assert torch.equal(emb_all, emb_kept)

