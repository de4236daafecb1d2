"""Optimizer state kept in fp32 for lower-precision parameters, also across ``load_state_dict``.

torch's ``Optimizer.load_state_dict`` casts every floating-point state tensor to its parameter's dtype, which suits
torch's own optimizers (their state has the parameter's dtype) but not one that keeps fp32 moments for a bf16 LoRA,
as transformers' Adafactor and bitsandbytes' 8-bit optimizers do: a continued run would round its moments to bf16
once and then keep updating them in bf16, so it would not train what the run that never stopped trains. Such an
optimizer also steps in fp32 (:func:`as_fp32`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["Fp32State", "as_fp32"]


class Fp32State(torch.optim.Optimizer):
    """An optimizer whose fp32 state tensors load back as fp32, on their parameter's device."""

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """torch's load, then each state tensor that was fp32 in ``state_dict`` put back as an fp32 copy (torch cast
        it to the parameter's dtype)."""
        kept = {int(index): {slot: value for slot, value in values.items()
                             if isinstance(value, torch.Tensor) and value.dtype == torch.float32}
                for index, values in state_dict["state"].items()}
        super().load_state_dict(dict(state_dict))
        params = [p for group in self.param_groups for p in group["params"]]
        for index, values in kept.items():
            param = params[index]
            for slot, value in values.items():
                self.state[param][slot] = value.detach().to(device=param.device, dtype=torch.float32, copy=True)


def as_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32: itself, or an fp32 copy (the ``.float()`` transformers' Adafactor and bitsandbytes take of a
    bf16 or fp16 tensor to step in fp32)."""
    return t if t.dtype == torch.float32 else t.float()
