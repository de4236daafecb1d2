"""``dataset_cache.lion8bit``: bitsandbytes' Lion8bit step, checked bit for bit against steps bitsandbytes took on
the CPU with its PyTorch quantizer, both on ATen's baseline kernels
(``tests/unit/data/lion8bit-reference-v1.safetensors``,
written by ``scripts/bnb8bit_reference.py``); with every moment fp32 it is our Lion; its state's slots and kinds,
chunks that change nothing, no value read back, a continued bf16 run."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from support.bnb_reference import replay_and_compare

from bench.bench_step_extras import count
from dataset_cache.lion import Lion
from dataset_cache.lion8bit import QUANTIZED_SLOTS, Lion8bit

SMALL = {"state1": "exp_avg"}
"""bitsandbytes' slot names -> ours, for a tensor with fp32 moments."""
QUANTIZED = {"state1": "exp_avg_q", "absmax1": "exp_avg_absmax"}
"""bitsandbytes' slot names -> ours, for a tensor with 8-bit moments."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("run", ["defaults", "decay"])
def test_each_step_is_bitsandbytes(run: str, dtype: torch.dtype) -> None:
    """Three steps over 8-bit tensors of whole and partial blocks, a small tensor with an fp32 moment and a vector:
    the weights, the moment's code indices and block scales, and the small tensors' moments equal bitsandbytes' bit
    for bit (fp32 and bf16 weights)."""
    moved, weights = replay_and_compare(Lion8bit, "Lion8bit", run, dtype, (0.9, 0.99), SMALL, QUANTIZED)
    assert moved > weights // 2  # the steps moved the weights (a bf16 weight of 0.1 may not move at lr 1e-3)


def test_with_every_moment_fp32_it_is_our_lion() -> None:
    """bitsandbytes' Lion arithmetic on fp32 moments (``min_8bit_size`` above every tensor) is Lion's (lion-pytorch's,
    :class:`~dataset_cache.lion.Lion`): the same weights and moments bit for bit, with weight decay."""
    g = torch.Generator().manual_seed(4)
    starts = [torch.randn(s, generator=g) for s in ((64, 80), (7,))]
    grads = [[torch.randn(s.shape, generator=g) for s in starts] for _ in range(4)]
    ours = [torch.nn.Parameter(s.clone()) for s in starts]
    theirs = [torch.nn.Parameter(s.clone()) for s in starts]
    settings = {"lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.1}
    eight, lion = Lion8bit(ours, min_8bit_size=1 << 30, **settings), Lion(theirs, **settings)
    for step in grads:
        for params, opt in ((ours, eight), (theirs, lion)):
            for p, grad in zip(params, step):
                p.grad = grad.clone()
            opt.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
        assert torch.equal(eight.state[a]["exp_avg"], lion.state[b]["exp_avg"])


def test_the_state_slots_kinds_and_reads() -> None:
    """A tensor of 4,096 elements or more keeps its moment as uint8 indices and a scale per block of 256 (the last
    partial); a smaller one an fp32 moment; a step count each; no step reads a value back to the host."""
    shapes = [(64, 64), (70, 61), (5,)]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in shapes]
    optimizer = Lion8bit(params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert count(optimizer.step)[1] == 0
    assert QUANTIZED_SLOTS == ("exp_avg_q", "exp_avg_absmax")
    want = [{"exp_avg_q": ((64, 64), torch.uint8), "exp_avg_absmax": ((16,), torch.float32)},
            {"exp_avg_q": ((70, 61), torch.uint8), "exp_avg_absmax": ((17,), torch.float32)},
            {"exp_avg": ((5,), torch.float32)}]
    for p, slots in zip(params, want):
        state = optimizer.state[p]
        assert {k: (tuple(v.shape), v.dtype) for k, v in state.items() if k != "step"} == slots
        assert state["step"] == 2


@pytest.mark.parametrize(("settings", "name"), [({"lr": -1.0}, "lr"), ({"betas": (1.0, 0.99)}, "betas[0]"),
                                               ({"betas": (0.9, float("nan"))}, "betas[1]"),
                                               ({"weight_decay": -0.1}, "weight_decay"),
                                               ({"min_8bit_size": 0}, "min_8bit_size")])
def test_bad_settings_are_refused_by_name(settings: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"Lion8bit: invalid {name} ")):
        Lion8bit([torch.nn.Parameter(torch.zeros(3))], **settings)
