"""``dataset_cache.adamw8bit``: bitsandbytes' AdamW8bit step, checked bit for bit against steps bitsandbytes took on
the CPU with its PyTorch quantizer, both on ATen's baseline kernels
(``tests/unit/data/adamw8bit-reference-v1.safetensors``,
written by ``scripts/bnb8bit_reference.py``; ``tests/support/bnb_reference.py`` says why those kernels), and the
properties a run needs: chunks that change nothing, layouts kept, per-tensor step counts, no value read back, fp32
state kept fp32 when a run continues."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from support.bnb_reference import replay_and_compare

from bench.bench_step_extras import count
from dataset_cache.adamw8bit import AdamW8bit, moment_shapes

SMALL = {"state1": "exp_avg", "state2": "exp_avg_sq"}
"""bitsandbytes' slot names -> ours, for a tensor with fp32 moments."""
QUANTIZED = {"state1": "exp_avg_q", "state2": "exp_avg_sq_q", "absmax1": "exp_avg_absmax",
             "absmax2": "exp_avg_sq_absmax"}
"""bitsandbytes' slot names -> ours, for a tensor with 8-bit moments."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("run", ["defaults", "decay"])
def test_each_step_is_bitsandbytes(run: str, dtype: torch.dtype) -> None:
    """Three steps over 8-bit tensors of whole and partial blocks, a small tensor with fp32 moments and a vector: the
    weights, the moments' code indices and block scales, and the small tensors' moments equal bitsandbytes' bit for
    bit (fp32 and bf16 weights)."""
    moved, weights = replay_and_compare(AdamW8bit, "AdamW8bit", run, dtype, (0.9, 0.999), SMALL, QUANTIZED)
    assert moved > weights // 2  # the steps moved the weights (a bf16 weight of 0.1 may not move at lr 1e-3)


def test_the_state_shapes_and_kinds_follow_the_size() -> None:
    """A tensor of 4,096 elements or more keeps uint8 indices and a scale per block of 256 (the last partial); a
    smaller one fp32 moments; no step reads a value back to the host (counted as the step benchmarks count)."""
    shapes = [(64, 64), (70, 61), (63, 64), (5,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    optimizer = AdamW8bit(params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()  # the first step makes the layout (its mask copied to the device once)
    assert count(optimizer.step)[1] == 0
    assert moment_shapes((70, 61)) == {"exp_avg_q": (70, 61), "exp_avg_absmax": (17,), "exp_avg_sq_q": (70, 61),
                                       "exp_avg_sq_absmax": (17,)}
    for p, shape in zip(params, shapes):
        state = optimizer.state[p]
        assert {k: tuple(v.shape) for k, v in state.items() if k != "step"} == moment_shapes(shape)
        assert all(v.dtype == (torch.uint8 if k.endswith("_q") else torch.float32)
                   for k, v in state.items() if k != "step")
        assert state["step"] == 2


@pytest.mark.parametrize(("settings", "name"), [({"lr": -1.0}, "lr"), ({"betas": (1.0, 0.999)}, "betas[0]"),
                                               ({"betas": (0.9, float("nan"))}, "betas[1]"), ({"eps": -1.0}, "eps"),
                                               ({"weight_decay": -0.1}, "weight_decay"),
                                               ({"min_8bit_size": 0}, "min_8bit_size"),
                                               ({"min_8bit_size": 100.5}, "min_8bit_size")])
def test_bad_settings_are_refused_by_name(settings: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"AdamW8bit: invalid {name} ")):
        AdamW8bit([torch.nn.Parameter(torch.zeros(3))], **settings)
