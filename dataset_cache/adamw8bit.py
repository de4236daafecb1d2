"""AdamW with 8-bit block-wise moments, as ``bitsandbytes.optim.AdamW8bit`` computes it: the default optimizer of
kohya's sd-scripts GUI and of ai-toolkit, so their recipes say ``AdamW8bit``. Written here in PyTorch, so no CUDA
package is needed; the codes, the quantization and the fused layout are :mod:`.blockwise8bit`'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .blockwise8bit import (
    BLOCK,
    MIN_8BIT_SIZE,
    Blockwise8bit,
    Codes,
    check_8bit_settings,
    dynamic_code,
    quantized_slots,
)
from .blockwise8bit import moment_shapes as _moment_shapes
from .fp32_state import as_fp32

__all__ = ["AdamW8bit", "BLOCK", "MIN_8BIT_SIZE", "QUANTIZED_SLOTS", "dynamic_code", "moment_shapes"]

MOMENTS = {"exp_avg": True, "exp_avg_sq": False}
"""AdamW's moments and whether each one's code is signed."""
QUANTIZED_SLOTS = quantized_slots(MOMENTS)
"""The state of an 8-bit tensor: each moment's code indices (uint8, the tensor's shape) and block scales (fp32)."""


def moment_shapes(shape: Sequence[int], min_8bit_size: int = MIN_8BIT_SIZE) -> dict[str, tuple[int, ...]]:
    """The moments' slots and shapes of a tensor of ``shape``: code indices and block scales when it has at least
    ``min_8bit_size`` elements, fp32 moments otherwise."""
    return _moment_shapes(shape, MOMENTS, min_8bit_size)


class AdamW8bit(Blockwise8bit):
    """``bitsandbytes.optim.AdamW8bit``'s step, with its arguments and defaults (weight decay 0.01).

    Per tensor ``p`` with gradient ``g`` at its step ``t`` (fp32): ``m ← β1·m + (1 − β1)·g``,
    ``v ← β2·v + (1 − β2)·g²``, ``p ← p·(1 − lr·weight_decay)``, then for an 8-bit tensor
    ``p ← p − lr/(1 − β1^t) · m / (√v / √(1 − β2^t) + eps)`` and ``m``, ``v`` quantized back; for a small one
    ``p ← p − lr·√(1 − β2^t)/(1 − β1^t) · m / (√v + eps·√(1 − β2^t))`` (bitsandbytes' two CPU formulas).

    State per tensor: ``step`` (an int) and :data:`QUANTIZED_SLOTS` or fp32 ``exp_avg`` and ``exp_avg_sq``
    (:func:`moment_shapes`); the block scales and small moments stay fp32 across ``load_state_dict``.
    """

    MOMENTS = MOMENTS

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, min_8bit_size: int = MIN_8BIT_SIZE) -> None:
        check_8bit_settings("AdamW8bit", lr, betas, eps, weight_decay, min_8bit_size)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "min_8bit_size": int(min_8bit_size)})

    def _step_small(self, group: dict[str, Any], params: list[torch.Tensor], t: int) -> None:
        """bitsandbytes' fp32-state AdamW step of tensors below ``min_8bit_size``, on their values laid out one after
        another (a bf16 LoRA's scalars and vectors would otherwise take two casts each)."""
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        targets = self._small_views(params)
        grad = as_fp32(torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]))
        value = as_fp32(torch.cat(targets["value"]))
        m, v = torch.cat(targets["exp_avg"]), torch.cat(targets["exp_avg_sq"])
        m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        c1, c2 = 1.0 - beta1 ** t, math.sqrt(1.0 - beta2 ** t)
        if decay > 0.0:
            value.mul_(1.0 - lr * decay)
        value.add_(m / (v.sqrt() + eps * c2), alpha=-lr * c2 / c1)
        sizes = [p.numel() for p in params]
        for flat, role in ((m, "exp_avg"), (v, "exp_avg_sq"), (value, "value")):
            torch._foreach_copy_(targets[role], list(flat.split(sizes)))

    def _step_quantized(self, group: dict[str, Any], params: list[torch.Tensor], t: int, codes: Codes) -> None:
        """bitsandbytes' 8-bit AdamW step of ``params`` laid out block after block (each tensor padded to whole
        blocks with zeros, which change no block's scale and are dropped after)."""
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        layout, values = self._chunk(params)
        m, v = self._dequantized(layout, params, codes)
        grad = layout.gather([p.grad.reshape(-1) for p in params if p.grad is not None])
        value = layout.gather(values)
        m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        del grad
        c1, c2 = 1.0 - beta1 ** t, math.sqrt(1.0 - beta2 ** t)
        denom = (v.sqrt() / c2).add_(eps)
        if decay > 0.0:
            value.mul_(1.0 - lr * decay)
        value.addcdiv_(m, denom, value=-lr / c1)
        del denom
        layout.scatter(value, values)
        del value  # the quantization's scratch below is the step's peak
        self._quantize(layout, params, codes, (m, v))
