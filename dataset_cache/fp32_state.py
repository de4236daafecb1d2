"""Optimizer state kept in its own dtype for lower-precision parameters, also across ``load_state_dict``.

torch's ``Optimizer.load_state_dict`` casts every state tensor of a floating-point parameter (``step`` aside) to the
parameter's dtype, which suits torch's own optimizers (their state has the parameter's dtype) but not one that keeps
fp32 moments for a bf16 LoRA, as transformers' Adafactor and bitsandbytes' 8-bit optimizers do: a continued run
would round its moments to bf16 once and then keep updating them in bf16, so it would not train what the run that
never stopped trains; nor one that keeps uint8 code indices (the 8-bit optimizers), which would come back as
bf16 or fp32 numbers (the same values, twice or four times the bytes, and refused by the next continuation's state
check). Such an optimizer also steps in fp32 (:func:`as_fp32`, :func:`fp32_copies`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["Fp32State", "as_fp32", "fp32_copies"]


class Fp32State(torch.optim.Optimizer):
    """An optimizer whose state tensors load back in the dtype they were saved in (fp32 moments and scales, uint8
    code indices), on their parameter's device."""

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """torch's load, then each state tensor of ``state_dict`` put back as a copy in its own dtype (torch cast it
        to the parameter's dtype)."""
        kept = {int(index): {slot: value for slot, value in values.items() if isinstance(value, torch.Tensor)}
                for index, values in state_dict["state"].items()}
        super().load_state_dict(dict(state_dict))
        params = [p for group in self.param_groups for p in group["params"]]
        for index, values in kept.items():
            param = params[index]
            for slot, value in values.items():
                self.state[param][slot] = value.detach().to(device=param.device, dtype=value.dtype, copy=True)


def as_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32: itself, or an fp32 copy (the ``.float()`` transformers' Adafactor and bitsandbytes take of a
    bf16 or fp16 tensor to step in fp32)."""
    return t if t.dtype == torch.float32 else t.float()


def fp32_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` in fp32, as :func:`as_fp32` gives each (the fp32 ones themselves, the others fp32 copies), the
    copies views of one new buffer filled by one fused copy: a ``.float()`` per tensor is a kernel per tensor on a
    GPU, thousands a step for a LoRA. Tensors on several devices are copied one by one."""
    out = list(tensors)
    low = [i for i, t in enumerate(out) if t.dtype != torch.float32]
    if not low or len({out[i].device for i in low}) > 1:
        return [as_fp32(t) for t in out]
    sizes = [out[i].numel() for i in low]
    flat = torch.empty(sum(sizes), dtype=torch.float32, device=out[low[0]].device)
    copies = [piece.view(out[i].shape) for piece, i in zip(flat.split(sizes), low)]
    torch._foreach_copy_(copies, [out[i] for i in low])
    for i, copy in zip(low, copies):
        out[i] = copy
    return out
