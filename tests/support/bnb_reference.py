"""Replaying the steps ``scripts/bnb8bit_reference.py`` recorded with bitsandbytes, for the 8-bit optimizers' tests:
the same starting weights and gradients through ours, every weight and state tensor compared bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

DATA = Path(__file__).resolve().parent.parent / "unit" / "data"


def replay_and_compare(cls: type, optimizer: str, run: str, dtype: torch.dtype, default_betas: tuple[float, float],
                       small: dict[str, str], quantized: dict[str, str]) -> tuple[int, int]:
    """Step ``cls`` through ``optimizer``'s recorded ``run`` with weights of ``dtype`` and assert every weight and
    state slot equals bitsandbytes' (``small`` and ``quantized``: bitsandbytes' slot names → ours, for the tensors
    with fp32 and with 8-bit moments) and each tensor's step count; return how many weights the steps moved, of how
    many."""
    with safe_open(str(DATA / f"{optimizer.lower()}-reference-v1.safetensors"), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())
    shapes, steps = json.loads(meta["shapes"]), int(meta["steps"])
    settings: dict[str, Any] = json.loads(meta["runs"])[run]
    params = [torch.nn.Parameter(tensors[f"start/{i}"].to(dtype, copy=True)) for i in range(len(shapes))]
    stepper = cls(params, **{**settings, "betas": tuple(settings.get("betas", default_betas))})
    for t in range(steps):
        for i, p in enumerate(params):
            p.grad = tensors[f"grad/{t}/{i}"].to(dtype)
        stepper.step()
    name = f"{run}/{str(dtype).removeprefix('torch.')}"
    moved = 0
    for i, p in enumerate(params):
        assert torch.equal(p.detach(), tensors[f"{name}/param/{i}"]), (name, shapes[i])
        moved += int((p.detach() != tensors[f"start/{i}"].to(dtype)).sum())
        state = stepper.state[p]
        names = small if set(small.values()) <= set(state) else quantized
        for theirs, ours in names.items():
            assert torch.equal(state[ours], tensors[f"{name}/{theirs}/{i}"]), (name, shapes[i], ours)
        assert state["step"] == steps
    return moved, sum(torch.Size(shape).numel() for shape in shapes)
